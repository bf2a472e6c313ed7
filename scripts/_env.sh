# Sourced by scripts/demo, scripts/test and scripts/bench: make .venv ready, idempotently.
# Installs the project with torch 2.13.0 and the Mooncake wheel that fits this machine
# (its CUDA 13 build where nvidia-smi sees a GPU, the -non-cuda build elsewhere).
# Leaves the caller where it stands: paths it was given are its own.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
(
cd "$ROOT"

# nvidia-smi never answers on a machine whose GPU or driver is stuck (fallen off the bus, a
# reset under way): asked with a deadline, whose end stops the script naming the command.
gpu=1
if command -v nvidia-smi >/dev/null 2>&1; then
  smi_s="${TRIPTYCH_NVIDIA_SMI_S:-30}"
  timeout -k 5 "$smi_s" nvidia-smi -L >/dev/null 2>&1 || gpu=$?
  if [ "$gpu" = 124 ] || [ "$gpu" = 137 ]; then
    echo "triptych: nvidia-smi -L did not answer within ${smi_s}s: the GPU or its driver is stuck (see dmesg);" \
      "fix it, or take nvidia-smi off the PATH to install the CPU build" >&2
    exit 1
  fi
fi
if [ "$gpu" = 0 ]; then
  # torch 2.13.0 from PyPI brings the CUDA 13 runtime. Mooncake's plain CUDA wheel links
  # libcudart.so.12, which then is nowhere (measured on an H200 with CUDA 13): the -cuda13
  # build is the same engine for that runtime.
  MOONCAKE="mooncake-transfer-engine-cuda13==0.3.13.post1"
  GPU_LIBS=(ibverbs-providers)  # that build links libmlx5 too
else
  MOONCAKE="mooncake-transfer-engine-non-cuda==0.3.13.post1"
  GPU_LIBS=()
fi

# The Debian packages of the libraries Mooncake's engine links (readelf -d engine.so), which
# pip cannot bring. Ubuntu 24.04 renamed some with a t64 suffix (libcurl4t64): either will do.
need_libs=()
for lib in libibverbs1 librdmacm1 libnuma1 libcurl4 "${GPU_LIBS[@]}"; do
  # dpkg-query fails for the name that does not exist; the other's status decides.
  { dpkg-query -W -f='${Status}\n' "$lib" "${lib}t64" 2>/dev/null || true; } | grep -q "install ok installed" ||
    need_libs+=("$lib")
done
if ((${#need_libs[@]})); then
  if [ "$(id -u)" = 0 ]; then
    echo "triptych: installing ${need_libs[*]} (Mooncake's import needs them)" >&2
    (apt-get install -y -qq "${need_libs[@]}" >/dev/null 2>&1 ||
      { apt-get update -qq >/dev/null && apt-get install -y -qq "${need_libs[@]}" >/dev/null; })
  else
    echo "triptych: Mooncake needs these libraries; run: sudo apt-get install -y ${need_libs[*]}" >&2
    exit 1
  fi
fi

STAMP=".venv/.triptych-installed"
WANT="$(echo "$ROOT"; cat pyproject.toml; echo "$MOONCAKE")"
# A venv whose creation was cut short (no python, or no pip in it), or made where the
# checkout no longer is (its scripts name the old path), is made anew.
if ! .venv/bin/python -m pip --version >/dev/null 2>&1 ||
   { [ -f "$STAMP" ] && [ "$(head -n 1 "$STAMP")" != "$ROOT" ]; }; then
  rm -rf .venv
  python3 -m venv .venv
fi
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "triptych: installing into .venv (first run takes a minute or two)" >&2
  # pip's output goes to a log, shown only if the install fails.
  pip_install() {
    .venv/bin/python -m pip install -q --disable-pip-version-check "$@" >.venv/install.log 2>&1 ||
      { cat .venv/install.log >&2; echo "triptych: pip install $* failed" >&2; exit 1; }
  }
  # Mooncake's builds share one package folder: another build's files would linger under this
  # one's (and go with either's uninstall), so a change of build starts from none.
  if .venv/bin/python -m pip list --format=freeze 2>/dev/null | grep -i '^mooncake-transfer-engine' |
     grep -qvi "^${MOONCAKE%%==*}=="; then
    .venv/bin/python -m pip uninstall -y -q mooncake-transfer-engine mooncake-transfer-engine-cuda13 \
      mooncake-transfer-engine-non-cuda >/dev/null 2>&1 || true
  fi
  # torch first and pinned: the version the project is tested with. (From PyPI alone that is
  # its CUDA build, also on a machine without a GPU; PIP_EXTRA_INDEX_URL, README, gets the CPU one.)
  pip_install "torch==2.13.0"
  pip_install "$MOONCAKE" -e ".[test]"
  .venv/bin/python -c "import torch, mooncake.engine, diffusers" >/dev/null
  printf '%s' "$WANT" > "$STAMP"
fi
)
export PATH="$ROOT/.venv/bin:$PATH"
