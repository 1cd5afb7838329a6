# Shared by scripts/main.sh and scripts/test.sh: create (once) and update (when the
# dependency files change) the project's virtual environment in .venv.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${SERVELAB_VENV:-$ROOT/.venv}"
export PIP_CONSTRAINT="${PIP_CONSTRAINT:-$ROOT/constraints/cpu.txt}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

servelab_setup() {  # $1: extras, e.g. "backend,test" ("" for the simulator alone)
    local extras="$1"
    if [ ! -x "$VENV/bin/python" ]; then
        echo "servelab: creating virtual environment in $VENV" >&2
        python3 -m venv "$VENV"
    fi
    local stamp="$VENV/.servelab-${extras:-core}.stamp"
    local want
    want="$(cat pyproject.toml "$PIP_CONSTRAINT" | sha256sum | cut -d' ' -f1)"
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
        echo "servelab: installing servelab[$extras] into $VENV (first run takes a few minutes)" >&2
        "$VENV/bin/python" -m pip install -q --upgrade pip
        # setuptools notes that an editable install of a package-dir layout works through an
        # import hook (information only; the layout is the design's): keep it off the screen.
        local quiet="ignore:Editable installation"
        if [ -n "$extras" ]; then
            PYTHONWARNINGS="$quiet" "$VENV/bin/python" -m pip install -q -e ".[$extras]"
        else
            PYTHONWARNINGS="$quiet" "$VENV/bin/python" -m pip install -q -e .
        fi
        echo "$want" > "$stamp"
    fi
}
