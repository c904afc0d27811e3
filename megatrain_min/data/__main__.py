"""python -m megatrain_min.data: the shipped corpus's size and one decoded batch (a demo). A
corpus is tokenized by `python -m megatrain_min.prepare`; given its arguments here, this says so
(exit 2)."""
import shlex
import sys

from megatrain_min.data import DEFAULT_DATA, Batches, decode, load_tokens, split

if sys.argv[1:] in (["-h"], ["--help"]):
    print("usage: python -m megatrain_min.data\n\n" + __doc__)
    sys.exit(0)
if sys.argv[1:]:   # `python -m megatrain_min.data prepare IN --out OUT`: the command moved
    given = shlex.join(sys.argv[2:]) if sys.argv[1] == "prepare" else "INPUT... --out DIR"
    print("error: python -m megatrain_min.data takes no arguments (it prints the shipped corpus "
          f"and a batch); a corpus is tokenized by python -m megatrain_min.prepare {given}",
          file=sys.stderr)
    sys.exit(2)
toks = load_tokens(DEFAULT_DATA)
tr, va = split(toks)
print(f"{DEFAULT_DATA.name}: {len(toks):,} bytes -> train {len(tr):,}, val {len(va):,}")
x, y = Batches(tr, 2, 64).next()
print(repr(decode(x[0])))
