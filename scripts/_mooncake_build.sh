# Run by scripts/_env.sh: print the Mooncake wheel that fits this machine, its CUDA 13 build
# where nvidia-smi sees a GPU, the -non-cuda build elsewhere.
set -uo pipefail

# nvidia-smi never answers on a machine whose GPU or driver is stuck (fallen off the bus, a
# reset under way): asked with a deadline, whose end stops the script naming the command.
status=127  # no nvidia-smi: no GPU
if command -v nvidia-smi >/dev/null 2>&1; then
  smi_s="${TRIPTYCH_NVIDIA_SMI_S:-30}"
  if timeout -k 5 "$smi_s" nvidia-smi -L >/dev/null 2>&1; then status=0; else status=$?; fi
  if [ "$status" = 124 ] || [ "$status" = 137 ]; then
    echo "triptych: nvidia-smi -L did not answer within ${smi_s}s: the GPU or its driver is stuck (see dmesg);" \
      "fix it, or take nvidia-smi off the PATH to install the CPU build" >&2
    exit 1
  fi
fi
if [ "$status" = 0 ]; then
  # torch 2.13.0 from PyPI brings the CUDA 13 runtime. Mooncake's plain CUDA wheel links
  # libcudart.so.12, which then is nowhere (measured on an H200 with CUDA 13): the -cuda13
  # build is the same engine for that runtime.
  echo "mooncake-transfer-engine-cuda13==0.3.13.post1"
else
  echo "mooncake-transfer-engine-non-cuda==0.3.13.post1"
fi
