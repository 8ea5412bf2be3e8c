"""The load's peak memory, measured in a child process (its peak resident set): a checkpoint loaded
with `--quantization int4` never holds the model whole at full precision, and the file's
pages are not counted as the process's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from safetensors.torch import load_file
from tiny_models import save_tiny_llama

# The child resets its peak resident memory (VmHWM, which ru_maxrss reports) after its
# imports, whose own transient peak would otherwise be the figure (Linux: clear_refs 5).
CHILD = """
import json, sys
from specmoe.config import ModelConfig
from specmoe.loader.model_loader import load_model
def status_mib(key):
    return int(open('/proc/self/status').read().split(key + ':')[1].split()[0]) / 1024
with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')
start = status_mib('VmRSS')
loaded = load_model(ModelConfig(sys.argv[1], dtype='float32', device='cpu',
                                quantization=sys.argv[2] if sys.argv[2] != 'none' else None))
final = sum(t.nbytes for t in (*loaded.model.parameters(), *loaded.model.buffers()))
print(json.dumps({'start_mib': start, 'peak_mib': status_mib('VmHWM'),
                  'final_mib': final / 2**20}))
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random Llama of 34 M parameters (136 MB in float32)."""
    path = save_tiny_llama(tmp_path_factory.mktemp("llama-34m"), vocab_size=2048,
                           hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                           num_attention_heads=8, num_key_value_heads=4,
                           max_position_embeddings=256)
    num_params = sum(t.numel() for t in load_file(path / "model.safetensors").values())
    return path, num_params * 4 / 2**20


def _load_in_child(path, quantization: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), quantization],
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_an_int4_load_never_holds_the_float32_model(checkpoint):
    path, float32_mib = checkpoint
    m = _load_in_child(path, "int4")
    assert m["final_mib"] < float32_mib / 4
    # measured: 68 MiB above the start (23 final + one layer's float32 weights and the
    # quantiser's temporaries); holding the float32 model whole and the file's pages, as the
    # load did before, 264
    assert m["peak_mib"] - m["start_mib"] < m["final_mib"] + 0.75 * float32_mib, m


def test_a_float32_load_peaks_near_its_weights(checkpoint):
    path, float32_mib = checkpoint
    m = _load_in_child(path, "none")
    assert m["final_mib"] == pytest.approx(float32_mib, rel=0.01)
    assert m["peak_mib"] - m["start_mib"] < 1.3 * m["final_mib"], m  # 1.13x; was 2.08x
