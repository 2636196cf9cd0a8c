"""Rank 0 samples a continuation of each of logging.sample_prompts when training ends."""

from __future__ import annotations

import torch

from pretrain.exit_codes import EXIT_OK
from pretrain.train.callbacks.base import Callback


class Samples(Callback):
    """Rank 0 samples a continuation of each of logging.sample_prompts when training ends."""

    def on_fit_end(self, trainer, exit_code: int | None) -> None:
        cfg, tok = trainer.cfg, trainer.run.data.tokenizer if trainer.run else None
        if exit_code != EXIT_OK or not trainer.train_started or not trainer.is_main or tok is None:
            return
        gen = torch.Generator(device=trainer.run.device).manual_seed(cfg.train.seed)
        print("samples:", flush=True)
        with torch.no_grad():
            for prompt in cfg.logging.sample_prompts:
                ids = tok.encode(prompt)
                room = cfg.seq_len - len(ids)  # positions the model was trained on
                if not ids or room <= 0:
                    continue
                out = trainer.run.module.model.generate(
                    torch.tensor([ids], device=trainer.run.device),
                    max_new_tokens=min(200, room),
                    temperature=0.8,
                    top_k=50,
                    generator=gen,
                )
                print("-" * 60 + "\n" + tok.decode(out[0].tolist()), flush=True)
        print("-" * 60, flush=True)
