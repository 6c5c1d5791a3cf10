"""Shared fixtures: the bundled model, random-weight checkpoints with awkward shapes, HF references."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from shardlm import bundled

PROMPT_TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
    "it was the season of Darkness, it was the spring of hope, it was the winter of despair."
)

# name -> (transformers config class name, config kwargs). Shapes chosen to be awkward for TP.
RANDOM_MODELS = {
    # 12 heads / 4 KV heads, vocab 1001: tp 5 splits heads 3,3,2,2,2 and straddles KV groups.
    "gqa12x4": ("LlamaConfig", dict(hidden_size=96, intermediate_size=200, num_hidden_layers=3,
                                    num_attention_heads=12, num_key_value_heads=4, vocab_size=1001)),
    # Qwen2: q/k/v bias, tied embeddings, 6 heads / 2 KV heads, odd vocab.
    "qwen2": ("Qwen2Config", dict(hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                                  num_attention_heads=6, num_key_value_heads=2, vocab_size=997,
                                  tie_word_embeddings=True, use_sliding_window=False)),
    # llama3 rope scaling with a short original context, so positions past 16 are scaled.
    "llama3rope": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=8, num_key_value_heads=2, vocab_size=1000,
                                       rope_theta=500000.0,
                                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    # Llama with attention and MLP biases, multi-head attention (no GQA).
    "biased_mha": ("LlamaConfig", dict(hidden_size=60, intermediate_size=130, num_hidden_layers=2,
                                       num_attention_heads=5, num_key_value_heads=5, vocab_size=503,
                                       attention_bias=True, mlp_bias=True)),
    # Mistral with a sliding window shorter than the prompts.
    "mistral_window": ("MistralConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=700,
                                             sliding_window=8, head_dim=16)),
}


def make_random_checkpoint(name: str, folder: Path, seed: int = 0) -> Path:
    """Write a random-weight HF checkpoint for RANDOM_MODELS[name] into `folder` (safetensors)."""
    import transformers

    cls_name, kwargs = RANDOM_MODELS[name]
    config = getattr(transformers, cls_name)(**kwargs, max_position_embeddings=512, initializer_range=0.15,
                                             bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # HF initializes biases to 0 and norm weights to 1, which would hide a bias
        for pname, p in model.named_parameters():  # or a norm weight that is never applied
            if pname.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "norm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


def hf_model(folder: Path):
    """The transformers reference model for a checkpoint folder, float32, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def bundled_dir() -> Path:
    """The bundled SmolLM2-135M-Instruct checkpoint (converted once per machine)."""
    return bundled.default_model_dir(progress=False)


@pytest.fixture(scope="session")
def random_dirs(tmp_path_factory) -> dict[str, Path]:
    """Every RANDOM_MODELS checkpoint, written once per test session."""
    root = tmp_path_factory.mktemp("random_models")
    return {name: make_random_checkpoint(name, root / name) for name in RANDOM_MODELS}


@pytest.fixture(scope="session")
def prompt64(bundled_dir) -> list[int]:
    """A 64-token prompt for the bundled model."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(bundled_dir)(PROMPT_TEXT)["input_ids"]
    assert len(ids) >= 64, len(ids)
    return ids[:64]


@pytest.fixture(scope="session")
def kernel_ext():
    """The compiled CPU kernels of this machine; the test skips (naming why) where they do not build."""
    from shardlm.kernels import build
    from shardlm.settings import Settings

    ops = build.extension(Settings().kernel_dir)
    if ops is None:
        pytest.skip("the compiled kernels do not build here (the log names why)")
    return ops


def read_json(path: Path) -> dict:
    """Parse a JSON file."""
    return json.loads(Path(path).read_text())


class _Replay:
    """Stands in for torch.cuda.CUDAGraph: replay() recomputes the step on the same buffers."""

    def __init__(self, graphs, rows, length, out):
        self.graphs, self.rows, self.length, self.out = graphs, rows, length, out

    def replay(self):
        self.out.copy_(self.graphs._forward(self.rows, self.length))


@pytest.fixture
def on_cpu(monkeypatch):
    """The serving engine's captured decode steps (runtime/slot_graphs.py) on the CPU: each replay is a plain call
    of the captured step on the same buffers."""
    from shardlm.runtime import slot_graphs

    def capture(self, rows, length):
        logits = self._forward(rows, length)  # writes what the replay writes (same inputs)
        return _Replay(self, rows, length, logits), logits

    monkeypatch.setattr(slot_graphs.SlotGraphs, "_capture", capture)



def bundled_copy(bundled_dir: Path, folder: Path, chat_template: str | None = None, weights: bool = False) -> Path:
    """`folder` holding the bundled model's tokenizer, its chat template replaced by `chat_template` (None: kept); with
    `weights`, also its config and weights (a hard link, or a copy on another file system: a checkpoint refuses
    symlinks that leave its folder)."""
    folder.mkdir(parents=True)
    names = ["tokenizer.json", "tokenizer_config.json"] + (["config.json"] if weights else [])
    if chat_template is None and (bundled_dir / "chat_template.jinja").is_file():
        names.append("chat_template.jinja")
    for name in names:
        shutil.copy(bundled_dir / name, folder / name)
    if chat_template is not None:
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": chat_template}))
    if weights:
        try:
            os.link(bundled_dir / "model.safetensors", folder / "model.safetensors")
        except OSError:
            shutil.copy(bundled_dir / "model.safetensors", folder / "model.safetensors")
    return folder


_BUILD_ROOT: list[Path] = []
"""The folder of the background kernel builds started at collection, removed when the session ends."""
_BUILD_MODULES: list = []
"""The test modules whose builds started (test_kernel_builds), waited for before the folder goes."""


def pytest_collection_finish(session):
    """Start test_kernel_builds' older kernel builds as soon as collection has chosen one of its tests, in the
    background at the lowest CPU priority: they overlap the tests that run before them."""
    if session.config.option.collectonly:
        return
    # only for the tests that take an older build (`arch`): a run of the module's other tests builds nothing
    for module in {item.module for item in session.items if item.module.__name__.endswith("test_kernel_builds")
                   and "arch" in getattr(item, "fixturenames", ())}:
        _BUILD_ROOT.append(Path(tempfile.mkdtemp(prefix="shardlm-builds-")))
        _BUILD_MODULES.append(module)
        module.start_builds(_BUILD_ROOT[-1])


def pytest_sessionfinish(session):
    """Remove the background kernel builds' folder, once the builds still running (a run stopped early) ended: a
    compiler writing into it after the removal had left the folder behind."""
    for module in _BUILD_MODULES:
        module.wait_builds(timeout_s=600)
    for root in _BUILD_ROOT:
        shutil.rmtree(root, ignore_errors=True)
