"""The shape-static decode step that CUDA graphs replay, checked on the CPU: writing the new key/value
at a slot held in a tensor and attending over the whole cache under a padded mask gives the
logits of the ordinary step."""

import torch
import torch.nn.functional as F

from refs import build
from shardlm.models.presets import PRESETS
from shardlm.models.random import write_random_checkpoint
from shardlm.runtime.step import Batch, Rows
from shardlm.settings import Settings


def test_static_slot_and_full_length_mask_give_the_ordinary_logits(tmp_path):
    config = {**PRESETS["debug"], "sliding_window": 9, "model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    folder = write_random_checkpoint(config, tmp_path / "m", seed=3)
    rank = build(folder, settings=Settings(kernels="torch"))
    model, args = rank.module, rank.args
    g = torch.Generator().manual_seed(0)
    batch = Batch.from_lists([torch.randint(3, 1001, (n,), generator=g).tolist() for n in (11, 4, 7)])
    runs = {}
    for static in (False, True):
        rows = Rows.for_model(rank, batch, 12)
        with torch.no_grad():
            rows.forward(model, batch.tokens, rows.prefill_mask())
            tokens, out = torch.tensor([5, 6, 7]), []
            for _ in range(12):
                mask = rows.next_token()  # (b, 1, 1, t)
                if static:
                    full = F.pad(mask, (0, rows.cache.max_len - mask.shape[-1]))  # (b, 1, 1, max_len)
                    slot = torch.tensor([rows.cache.offset])
                    with rows.cache.static(slot):
                        logits = model(tokens[:, None], rows.positions, full, rows.cache, last_only=True)
                    rows.cache.advance(1)
                else:
                    logits = rows.forward(model, tokens[:, None], mask)
                out.append(logits)
                tokens = logits[:, -1].argmax(-1)
        runs[static] = torch.cat(out, dim=1)
    torch.testing.assert_close(runs[True], runs[False], rtol=1e-5, atol=1e-5)
