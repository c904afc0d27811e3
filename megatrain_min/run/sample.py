"""sample.py -- text from trained weights: what train.py prints at the end of a run.

What it is
    generate(cfg, weights, ids, n): n tokens after the context ids, each drawn from the softmax of
    the last position's logits at a temperature, with a seeded generator (the same run prints the
    same text); show() prints them; closing() is train.py's sample at the end of a run. The
    context the model sees is the last `window` tokens: the trained --seq-len (RoPE positions past
    it were never seen, and the text degenerates there), at most 1024 (a plain forward per token,
    no KV cache).
What it is not
    Not an inference engine: no KV cache, no batching, no top-k or top-p; the whole model on the
    CPU.
"""
import torch

import model

TEMPERATURE = 0.8
MAX_WINDOW = 1024


def generate(cfg, weights, ids, n, window=MAX_WINDOW, temperature=TEMPERATURE, seed=0, stop=None):
    """The n (at most) token ids sampled after `ids` (a list); stops early after the token
    `stop`."""
    ctx = torch.tensor([list(ids)], dtype=torch.long)
    gen, window, out = torch.Generator().manual_seed(seed), min(window, MAX_WINDOW), []
    with torch.no_grad():
        for _ in range(n):
            logits = model.forward(cfg, weights, ctx[:, -window:])[0, -1]
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)
            ctx = torch.cat([ctx, nxt[None]], dim=1)
            out.append(int(nxt))
            if out[-1] == stop:
                break
    return out


def show(cfg, weights, source, n, window, seed):
    """Print n tokens sampled after the data source's prompt, decoded, between two rules."""
    ids = generate(cfg, weights, source.prompt, n, window=window, seed=seed, stop=source.stop)
    rule = "-" * 40
    print(f"{rule} {source.what} (temperature {TEMPERATURE})\n{source.decode(ids)}\n{rule}")


def closing(cfg, trainer, source, n, window, seed, rank=0, world=1):
    """train.py's last words: n tokens after the data's prompt from the trained weights, printed by
    rank 0 -- none for a model of 2B parameters or more (a plain forward on the CPU per token), nor
    for data without a prompt. Under torchrun every rank calls it: the weights gather on rank 0."""
    if not (n and model.n_params(cfg) < 2e9 and source.prompt and source.decode):
        return
    final = trainer.weights(to=0) if world > 1 else trainer.weights()
    show(cfg, final, source, n if rank == 0 else 0, window=window, seed=seed)
