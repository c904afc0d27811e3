"""Make the repository root importable (model.py, stream.py, optim.py live there) and share helpers: random
batches, tiny tokenizers, a fast runner of train.py (TrainCLI) and the "nothing lost" check (assert_refused)."""
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import model  # noqa: E402

# grouped-query attention, Qwen2 qkv bias, Qwen3 q/k norm with an explicit head_dim, tied embeddings
SPECIAL = model.GPTConfig(vocab_size=97, n_layer=3, n_head=4, n_kv_head=2, d_model=64, d_ff=96, head_dim=32,
                          qkv_bias=True, qk_norm=True, tie_embeddings=True, max_seq_len=64)


def random_batch(cfg, B, T, gen, ignore_frac=0.2):
    """tokens, targets (B, T); a fraction of the targets set to -100."""
    tok = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)
    tgt = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)
    tgt[torch.rand(B, T, generator=gen) < ignore_frac] = model.IGNORE
    return tok, tgt


def losses_agree(a, b, cfg, gen, steps, B, T, rtol):
    """Step trainers a and b on the same random batches; every step's losses agree to rtol (relative)."""
    for s in range(steps):
        tok, tgt = random_batch(cfg, B, T, gen)
        la, lb = a.step(tok, tgt), b.step(tok, tgt)
        assert abs(la - lb) / abs(lb) <= rtol, f"step {s}: loss {la} vs {lb}"


def update_rel(w0, wa, wb):
    """||(wa - w0) - (wb - w0)|| / ||wb - w0|| over all tensors: how far two updates are apart."""
    num = sum(((wa[k] - wb[k]).double() ** 2).sum() for k in wb) ** 0.5
    den = sum(((wb[k] - w0[k]).double() ** 2).sum() for k in wb) ** 0.5
    return float(num / den)


def make_bpe_tokenizer(directory, texts, vocab_size, special_tokens, tokenizer_config):
    """A tiny byte-level BPE tokenizer trained here on `texts`, saved as directory/tokenizer.json with a
    tokenizer_config.json (nothing is downloaded). Returns the tokenizers.Tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return tok


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


# ----------------------------------------------------------------------------- train.py as a user runs it, fast
# Every `python train.py ...` pays ~3 CPU-seconds importing torch before it looks at a flag. TrainCLI pays it
# once: a helper process imports train.py's dependencies (and computes nothing, so forking it is safe: no
# OpenMP team exists yet), then forks one fresh child per run. The child runs train.py as __main__ in its own
# process -- own pid, cwd, stdout/stderr files, exit code, signals, file locks -- and ends the way the
# interpreter ends a script: SystemExit's code, or the traceback of an uncaught exception and exit code 1.
ZYGOTE = r"""
import json, os, resource, runpy, signal, sys, traceback
sys.path.insert(0, sys.argv[1])
import numpy, torch, tqdm, model, optim, stream  # noqa: the imports train.py would pay for on every run
from megatrain_min import checkpoint, data, hf, plan, reference  # noqa
for line in sys.stdin:
    req = json.loads(line)
    if "wait" in req:
        print(json.dumps({"rc": os.waitstatus_to_exitcode(os.waitpid(req["wait"], 0)[1])}), flush=True)
        continue
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(req["cwd"])
            for fd, path in ((0, os.devnull), (1, req["stdout"]), (2, req["stderr"])):
                os.dup2(os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC), fd)
            if req["fsize"] is not None:                  # `ulimit -f`: a write past it fails with EFBIG
                resource.setrlimit(resource.RLIMIT_FSIZE, (req["fsize"], req["fsize"]))
            if req["modes"]:                              # root ignores file modes: drop CAP_DAC_OVERRIDE and
                import ctypes                             # CAP_DAC_READ_SEARCH (capability bits 1, 2) so they apply
                libc = ctypes.CDLL(None, use_errno=True)
                hdr, caps = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()  # v3 header, 2 x (eff, prm, inh)
                libc.capget(hdr, caps)
                caps[0] &= ~0b110
                if libc.capset(hdr, caps):
                    raise OSError(ctypes.get_errno(), "capset")
            signal.alarm(req["timeout"])                  # a hung run is killed
            sys.argv = [os.path.join(sys.argv[1], "train.py"), *req["argv"]]
            runpy.run_path(sys.argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else (print(e.code, file=sys.stderr), 1)[1]
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(code)
    print(json.dumps({"pid": pid}), flush=True)
"""


class TrainCLI:
    """cli(*args, cwd=...) -> subprocess.CompletedProcess of `python train.py *args`; cli.start(...) -> a Run
    with .pid, whose result cli.wait(run) gives (runs may overlap: the lock and signal tests).
    fsize: RLIMIT_FSIZE in bytes; modes: file modes apply even to root (the tests run as root in containers)."""

    def __init__(self, tmp):
        self.tmp, self.n = tmp, 0
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE, str(ROOT)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def _ask(self, req):
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def start(self, *args, cwd, fsize=None, modes=False, timeout=120):
        self.n += 1
        out, err = self.tmp / f"{self.n}.out", self.tmp / f"{self.n}.err"
        argv = [str(a) for a in args]
        pid = self._ask(dict(argv=argv, cwd=str(cwd), stdout=str(out), stderr=str(err), fsize=fsize, modes=modes,
                             timeout=timeout))["pid"]
        return SimpleNamespace(pid=pid, argv=argv, out=out, err=err)

    def wait(self, run):
        rc = self._ask({"wait": run.pid})["rc"]
        return subprocess.CompletedProcess(["train.py", *run.argv], rc, run.out.read_text(), run.err.read_text())

    def __call__(self, *args, **kw):
        return self.wait(self.start(*args, **kw))

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="session")
def cli(tmp_path_factory):
    runner = TrainCLI(tmp_path_factory.mktemp("cli"))
    yield runner
    runner.close()


def wait_for_training(out, timeout=120):
    """Block until the run writing to `out` has logged its first step."""
    deadline = time.time() + timeout
    while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").stat().st_size):
        assert time.time() < deadline, f"no step logged in {out} after {timeout} s"
        time.sleep(0.02)


# ----------------------------------------------------------------------------- "nothing lost"
def files_under(*roots):
    """{path: bytes} of every file under the given directories (or files): what 'nothing lost' compares."""
    found = {}
    for root in map(Path, roots):
        for p in [root] if root.is_file() else sorted(root.rglob("*")) if root.is_dir() else []:
            if p.is_file():
                found[p] = p.read_bytes()
    return found


def lost(before):
    """The files of `before` (files_under's result) that are gone or changed now; [] = nothing lost."""
    return [str(p) for p, b in before.items() if not p.is_file() or p.read_bytes() != b]


def assert_refused(r, before, code=2, words=()):
    """train.py refused or stopped as documented: exit `code`, one line on stderr holding `words`, no
    traceback, and every file that existed before the run is still there byte for byte."""
    err = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == code, f"exit {r.returncode}, expected {code}\n{r.stderr}"
    assert len(err) == 1 and all(w in err[0] for w in words), r.stderr
    assert not lost(before), lost(before)
