# Sourced by scripts/demo, test, bench, bench-handoff and soak: make .venv ready, idempotently.
# Installs the project with torch 2.13.0 and the Mooncake wheel that fits this machine
# (its CUDA 13 build where nvidia-smi sees a GPU, the -non-cuda build elsewhere).
# Leaves the caller where it stands: paths it was given are its own.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
(
cd "$ROOT"

# The wheel for this machine; a stuck GPU or driver (nvidia-smi does not answer) stops the script here.
MOONCAKE="$(bash scripts/_mooncake_build.sh)"
if [[ "$MOONCAKE" == *-cuda13==* ]]; then
  GPU_LIBS=(ibverbs-providers)  # that build links libmlx5 too
else
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
