"""reference.py -- the oracle: plain PyTorch training with the whole model in memory.

What it is
    ReferenceTrainer has the same surface as stream.Trainer (step, evaluate, set_lr, weights, wait,
    a None guard) and checks its arguments with the same functions (megatrain_min/engine/checks.py),
    but does the obvious thing: every weight is a leaf tensor on one device, one autograd graph per
    micro-batch, torch.nn.utils.clip_grad_norm_, torch.optim.AdamW(fused=True) (or the optimizer it
    is handed) with two parameter groups (decay on tensors with >= 2 dims). `python train.py
    --engine reference` uses it; the tests hold the streaming engine to it.
What it is not
    Not fast and not memory-frugal on purpose: any cleverness here would weaken it as an oracle.
"""
import torch

import model
import optim
import stream
from megatrain_min.engine.checks import (check_batch, check_device, check_finite, check_hyper,
                                  check_tensor, check_weights)


class ReferenceTrainer:
    def __init__(self, cfg, weights, device=None, dtype=torch.float32, lr=optim.LR,
                 betas=optim.BETAS,
                 eps=optim.EPS, weight_decay=optim.WEIGHT_DECAY, grad_clip=stream.GRAD_CLIP,
                 micro_batches=stream.MICRO_BATCHES, optimizer=None):
        """stream.Trainer's arguments and defaults (device None: optim.resolve_device's choice), but
        dtype: the autocast dtype (default fp32: none), and optimizer: optimizer(param_groups, lr)
        -> a torch.optim.Optimizer, the oracle of the engine's update rule (None:
        torch.optim.AdamW(betas, eps, fused=True), optim.AdamW's)."""
        check_hyper(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, grad_clip=grad_clip,
                    micro_batches=micro_batches)
        # the keys; each tensor is checked as it is copied
        check_weights(cfg, weights, tensors=False)
        self.cfg, self.dev, self.dtype = cfg, check_device(device), dtype
        self.grad_clip, self.M = grad_clip, micro_batches
        self.guard = None                              # the oracle never skips a step
        shapes = {e.key: e.shape for lay in model.units(cfg) for e in lay.entries}
        self.params = {
            k: check_tensor(k, v, shapes[k]).to(self.dev, torch.float32).clone().requires_grad_()
                       for k, v in weights.items()}
        check_finite(self.params)
        decay = [p for p in self.params.values() if p.dim() >= 2]
        no_decay = [p for p in self.params.values() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        if optimizer is None:
            self.opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
        else:
            self.opt = optimizer(groups, lr)

    def step(self, tokens, targets):
        """One optimizer step over (B, T) tokens/targets in self.M micro-batches; returns the mean
        loss."""
        check_batch(self.cfg, tokens, targets)
        n = (targets != model.IGNORE).sum().clamp(min=1).item()  # tokens of the whole step
        total = 0.0
        for tok, tgt in zip(tokens.chunk(self.M), targets.chunk(self.M)):
            tok, tgt = tok.to(self.dev), tgt.to(self.dev)
            with torch.autocast(self.dev.type, dtype=self.dtype,
                                enabled=self.dtype != torch.float32):
                h = model.hidden(self.cfg, self.params, tok)
                loss_sum = model.chunked_loss_sum(self.cfg, h,
                                                  model.head_weights(self.cfg, self.params), tgt,
                                                  model.default_chunk_tokens(self.cfg))
            (loss_sum / n).backward()
            total += loss_sum.item()
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(list(self.params.values()), self.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total / n

    @torch.no_grad()
    def evaluate(self, tokens, targets):
        """Mean loss of (tokens, targets) with the current weights (same autocast as step)."""
        check_batch(self.cfg, tokens, targets)
        with torch.autocast(self.dev.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            return model.loss(self.cfg, self.params, tokens.to(self.dev),
                              targets.to(self.dev)).item()

    def wait(self):
        """Nothing runs in the background here (stream.Trainer's surface)."""

    def set_lr(self, lr):
        check_hyper(lr=lr)
        for g in self.opt.param_groups:
            g["lr"] = lr

    def weights(self):
        return {k: v.detach().cpu().clone() for k, v in self.params.items()}
