# %% [markdown]
# # Lesson 7 -- fine-tuning a real checkpoint: load, SFT on a JSONL file, export, load back
#
# **What you will learn**
#
# * that a Hugging Face Llama checkpoint *is* the project's weights dict: `model.py` names every
#   tensor like transformers does, so `megatrain_min.hf.load.load_hf` is a rename-free, lazy copy
#   into the host store;
# * how supervised fine-tuning data is built: chat or prompt/completion lines in a `.jsonl` file,
#   one example per row, conversations rendered in the model's *own* chat template (the jinja
#   program in its tokenizer_config.json), the loss only on the answer tokens (targets `-100`
#   elsewhere, lesson 2's `IGNORE`);
# * how to export with `save_hf` and check the round trip in transformers itself: same logits, same
#   loss, and the prompt transformers builds at inference is exactly the start of what the model was
#   trained on.
#
# Everything so far trained from random weights. Real use starts from a pretrained model: here a
# tiny random Llama made with `transformers` stands in for it (a real one is the same files, only
# bigger:
# `load_hf("path/to/Llama-3.2-1B")`), so the lesson runs offline in seconds.
#
# Needs `transformers` (a dev dependency: `pip install -r requirements-dev.txt`).
# Run it: `python tutorials/07_finetune_real_checkpoint.py` (~5 s on a 2-core CPU: imports and 100
# steps).

# %%
import json
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = (Path(__file__).resolve().parents[1] if "__file__" in globals()   # a script, or a notebook
        else Path.cwd().resolve().parent)                                 # run from tutorials/
sys.path.insert(0, str(ROOT))
import model  # noqa: E402
from megatrain_min import data  # noqa: E402
from megatrain_min.data import chat  # noqa: E402
from megatrain_min.hf import save_hf  # noqa: E402
from megatrain_min.hf.load import load_hf  # noqa: E402
from megatrain_min.data.tokenizer import HFTokenizer  # noqa: E402
from megatrain_min.run.schedule import lr_at  # noqa: E402
from stream import Trainer  # noqa: E402

try:
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
except ImportError as e:
    raise SystemExit(f"lesson 7 needs transformers and tokenizers ({e}); pip install -r "
                     "requirements-dev.txt")

transformers.utils.logging.disable_progress_bar()
torch.manual_seed(0)
work = tempfile.TemporaryDirectory(prefix="megatrain_min_lesson07_")    # removed at the end
WORK = Path(work.name)

# %% [markdown]
# ## 1. Some fine-tuning data
#
# A `.jsonl` file, one example per line, in either shape `data.load_sft_jsonl` reads:
#
# * a chat, the loss on every assistant turn:
#   `{"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]}`;
# * `{"prompt": ..., "completion": ...}` -- a raw pair, the loss on the completion.

# %%
CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Egypt": "Cairo", "Peru": "Lima",
            "Kenya": "Nairobi", "Spain": "Madrid", "Chile": "Santiago", "Norway": "Oslo",
            "Cuba": "Havana"}
rows = [{"messages": [{"role": "user", "content": f"Capital of {c}?"},
                      {"role": "assistant", "content": f"{city}."}]}
        for c, city in CAPITALS.items()]
rows += [{"prompt": f"The capital of {c} is", "completion": f" {city}."}
         for c, city in CAPITALS.items()]
sft_path = WORK / "capitals.jsonl"
sft_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
print(f"{sft_path.name}: {len(rows)} examples, e.g.\n  {sft_path.read_text().splitlines()[0]}")

# %% [markdown]
# ## 2. A "pretrained" checkpoint
#
# A real model directory holds `config.json`, `model.safetensors` (or shards + an index) and a
# tokenizer (`tokenizer.json` + `tokenizer_config.json`, which carries the model's **chat
# template**). We make each one: a tiny byte-level BPE tokenizer trained on the text above, with
# ChatML's turn markers `<|im_start|>` and `<|im_end|>` as special tokens (ChatML is the format of
# Qwen; Llama 3 and Mistral have their own), the template as a short jinja program, and a random
# `LlamaForCausalLM` with grouped-query attention (4 query heads sharing 2 key/value heads), saved
# with `save_pretrained`.

# %%
base = WORK / "base"
base.mkdir()
BOS, EOS, IM_START, IM_END = "<s>", "</s>", "<|im_start|>", "<|im_end|>"
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator([sft_path.read_text(), "user\nassistant\n"],
                        trainers.BpeTrainer(vocab_size=320,
                                            special_tokens=[BOS, EOS, IM_START, IM_END],
                                            show_progress=False,
                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
tok.save(str(base / "tokenizer.json"))
(base / "tokenizer_config.json").write_text(
    json.dumps({"bos_token": BOS, "eos_token": EOS, "chat_template": CHATML}))

hf_cfg = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64,
                                  intermediate_size=172,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=128, tie_word_embeddings=False,
                                  bos_token_id=tok.token_to_id(BOS),
                                  eos_token_id=tok.token_to_id(EOS))
transformers.LlamaForCausalLM(hf_cfg).save_pretrained(base)
print("base checkpoint:", sorted(p.name for p in base.iterdir()))

# %% [markdown]
# ## 3. Load it: `load_hf`
#
# `load_hf(dir)` translates `config.json` into a `GPTConfig` and returns the weights as a *lazy*
# mapping
# `{HF key: fp32 tensor}`: each tensor is read from the safetensors file when it is accessed, so the
# engine fills its host store one tensor at a time (a 70B checkpoint never sits in memory twice).
# First check the maths: our plain `model.forward` against transformers' own forward on the same
# file.

# %%
def hf_load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


cfg, weights = load_hf(base)
print(f"GPTConfig: L={cfg.n_layer} d={cfg.d_model} heads={cfg.n_head}/{cfg.n_kv_head} "
      f"ff={cfg.d_ff} V={cfg.vocab_size}, {model.n_params(cfg):,} params")
probe = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    ours, theirs = model.forward(cfg, weights, probe), hf_load(base)(probe).logits
diff_base = ((ours - theirs).abs().max() / theirs.abs().max()).item()
print(f"model.forward vs transformers on the base checkpoint: max rel diff {diff_base:.1e}")

# %% [markdown]
# ## 4. Tokenize the data with the model's tokenizer
#
# `HFTokenizer(dir)` (megatrain_min/data/tokenizer.py) reads `tokenizer.json` (the `tokenizers`
# package, no transformers at run time), finds bos/eos and the chat template.
# `data.chat_tokens(tokenizer, messages)` renders a conversation with that template (jinja2, as
# transformers' `apply_chat_template` does: the same ids, token for token) and marks the tokens to
# learn: each assistant answer and the end-of-turn marker after it (`<|im_end|>`, so the model
# learns to stop), not the newline the template adds after it, not the prompt. `load_sft_jsonl` does
# this for every line and shifts by one: `y[i]` is the target after `x[i]`. A prompt/completion line
# is used verbatim: `<s>` + prompt + completion + `</s>`. Print one example of each: `.` is a target
# without loss, its text otherwise.

# %%
tokenizer = HFTokenizer(base)
ids, supervised = data.chat_tokens(tokenizer, rows[0]["messages"])
print("rendered, loss on [[ ]]:", repr(chat.layout(tokenizer, ids, supervised)))
SEQ = 32
examples = data.load_sft_jsonl(sft_path, tokenizer, seq_len=SEQ)
for x0, y0 in (examples[0], examples[len(CAPITALS)]):
    print("tokens :", repr(tokenizer.decode(x0)))
    print("targets:",
          " ".join("." if t == data.IGNORE else repr(tokenizer.decode([t])) for t in y0))
batches = data.SFTBatches(examples, batch_size=8, seq_len=SEQ, seed=0, pad_id=tokenizer.eos_id)

# %% [markdown]
# ## 5. Fine-tune with the streaming engine
#
# The same `stream.Trainer` as in lessons 2-5: weights in the host store, one layer at a time, here
# on the CPU, with the warmup + cosine schedule of `megatrain_min.run.schedule.lr_at`. The loss is
# the mean over the answer tokens only. A fixed evaluation batch of all 20 examples shows what was
# learned (the model is memorising 10 facts: enough to see the machinery work, not a generalisation
# result).

# %%
t = Trainer(cfg, weights, device="cpu", lr=1e-2, weight_decay=0.0, grad_clip=1.0, micro_batches=2)
eval_x = torch.full((len(examples), SEQ), tokenizer.eos_id)
eval_y = torch.full((len(examples), SEQ), data.IGNORE)
for i, (x, y) in enumerate(examples):
    eval_x[i, :len(x)], eval_y[i, :len(y)] = torch.from_numpy(x), torch.from_numpy(y)
before = t.evaluate(eval_x, eval_y)
STEPS = 100
for step in range(STEPS):
    t.set_lr(lr_at(step, 1e-2, STEPS, warmup=10))             # linear warmup, cosine decay to 10%
    loss = t.step(*batches.next())
    if step % 20 == 0 or step == STEPS - 1:
        print(f"  step {step:>2}: train loss {loss:.3f}")
after = t.evaluate(eval_x, eval_y)
print(f"loss on the answers: {before:.3f} before, {after:.3f} after fine-tuning")

# %% [markdown]
# ## 6. Export with `save_hf` and load it back in transformers
#
# `save_hf(cfg, weights, dir)` writes `config.json`, safetensors shards (bf16 by default; fp32 here
# so the round trip is exact) and, with `tokenizer_from`, the tokenizer files. Then transformers
# loads it like any other model -- the proof that the export is a real checkpoint: the same logits
# as our forward, and the same loss on the answers as the engine's `evaluate`.

# %%
tuned = t.weights()                                      # {HF key: fp32 tensor}, the master weights
out = save_hf(cfg, tuned, WORK / "tuned", dtype=torch.float32, tokenizer_from=base)
print("exported:", sorted(p.name for p in out.iterdir()))
hf = hf_load(out)
with torch.no_grad():
    theirs = hf(probe).logits
    ours = model.forward(cfg, tuned, probe)
    hf_logits = hf(eval_x).logits                              # (20, SEQ, V)
diff_tuned = ((ours - theirs).abs().max() / theirs.abs().max()).item()
hf_loss = F.cross_entropy(hf_logits.reshape(-1, cfg.vocab_size), eval_y.reshape(-1),
                          ignore_index=data.IGNORE).item()
print(f"transformers vs model.forward on the exported model: max rel diff {diff_tuned:.1e}")
print(f"loss on the answers: transformers {hf_loss:.5f}, engine {after:.5f}")

# greedy answers from the exported model, all in transformers: its tokenizer (copied along by
# save_hf, with the chat template) builds the prompt -- which is exactly the start of what the model
# was trained on
hf_tok = transformers.AutoTokenizer.from_pretrained(out)
end_id = tokenizer.tok.token_to_id(IM_END)
for country in ("France", "Peru"):
    question = [{"role": "user", "content": f"Capital of {country}?"}]
    prompt = list(hf_tok.apply_chat_template(question, add_generation_prompt=True)["input_ids"])
    trained = data.chat_tokens(
        tokenizer, question + [{"role": "assistant", "content": f"{CAPITALS[country]}."}])[0]
    assert trained[:len(prompt)].tolist() == prompt, (prompt, trained)
    x = torch.tensor([prompt])
    with torch.no_grad():
        while x.shape[1] < len(prompt) + 8 and x[0, -1] != end_id:
            x = torch.cat([x, hf(x).logits[:, -1:].argmax(-1)], dim=1)  # the most likely next token
    print(f"  Capital of {country}? -> {tokenizer.decode(x[0, len(prompt):].tolist())!r}")

# %% [markdown]
# ## Check
#
# * our model maths equals transformers' on the base checkpoint and on the exported one;
# * fine-tuning lowered the loss on the answers by more than half (it memorises them);
# * transformers computes the same SFT loss on the exported weights as the engine did on its host
#   store;
# * transformers' inference prompt (`apply_chat_template(..., add_generation_prompt=True)`) is a
#   prefix of the training rendering (asserted above for each question asked).

# %%
assert diff_base <= 1e-4, diff_base
assert diff_tuned <= 1e-4, diff_tuned
assert after < 0.5 * before, (before, after)
assert abs(hf_loss - after) <= 1e-4 * after, (hf_loss, after)
work.cleanup()
print(f"OK  logits vs transformers {diff_base:.1e} (base), {diff_tuned:.1e} (exported); "
      f"answer loss {before:.2f} -> {after:.2f}; transformers loss == engine loss "
      f"(rel diff {abs(hf_loss - after) / after:.1e})")
