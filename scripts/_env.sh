# Sourced by scripts/demo, scripts/test and scripts/bench: make .venv ready, idempotently.
# Installs the project with torch 2.13.0 and the Mooncake wheel that fits this machine
# (CUDA build where nvidia-smi sees a GPU, the -non-cuda build elsewhere).
# Leaves the caller where it stands: paths it was given are its own.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
(
cd "$ROOT"

need_libs=()
for lib in libibverbs1 librdmacm1 libnuma1; do
  dpkg-query -W -f='${Status}' "$lib" 2>/dev/null | grep -q "install ok installed" || need_libs+=("$lib")
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

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  MOONCAKE="mooncake-transfer-engine==0.3.13.post1"
else
  MOONCAKE="mooncake-transfer-engine-non-cuda==0.3.13.post1"
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
  # torch first and pinned: an open range would pull a multi-GB CUDA build.
  pip_install "torch==2.13.0"
  pip_install "$MOONCAKE" -e ".[test]"
  .venv/bin/python -c "import torch, mooncake.engine, diffusers" >/dev/null
  printf '%s' "$WANT" > "$STAMP"
fi
)
export PATH="$ROOT/.venv/bin:$PATH"
