# Sourced by run_train.sh and run_tests.sh: sets PYTHON, creating .venv on first use.
#
# TEMPER_PYTHON=/path/to/python skips the virtualenv and uses that interpreter with
# this checkout on PYTHONPATH (a cluster image, a machine without network).

TEMPER_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [ -n "${TEMPER_PYTHON:-}" ]; then
  PYTHON="$TEMPER_PYTHON"
  export PYTHONPATH="$TEMPER_ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
  venv="$TEMPER_ROOT/.venv"
  stamp="$venv/.temper-installed"
  wanted="$(sha256sum "$TEMPER_ROOT/pyproject.toml" | cut -d' ' -f1)"
  if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
    base="${TEMPER_BOOTSTRAP_PYTHON:-python3}"
    if ! "$base" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
      echo "temper: $base is older than Python 3.10; set TEMPER_BOOTSTRAP_PYTHON" >&2
      exit 1
    fi
    echo "temper: setting up $venv (first run only: installs torch and the project)..."
    [ -x "$venv/bin/python" ] || "$base" -m venv "$venv" || exit 1
    # The pinned CPU build lies on these machines' disk; elsewhere take any torch >= 2.11.
    "$venv/bin/pip" install --quiet --disable-pip-version-check torch==2.13.0 2>/dev/null \
      || "$venv/bin/pip" install --quiet --disable-pip-version-check "torch>=2.11" || exit 1
    "$venv/bin/pip" install --quiet --disable-pip-version-check -e "$TEMPER_ROOT[dev]" || exit 1
    echo "$wanted" > "$stamp"
    echo "temper: environment ready"
  fi
  PYTHON="$venv/bin/python"
fi
export PYTHON
