"""megatrain_min: the periphery of megatrain-min, in packages by concern; the engine itself is
the four core files at the top level (model.py, stream.py, optim.py, train.py).

    engine/        what stream.Trainer is handed (homes: resident, GPU-updated; the boundary
                   activations' store, tiling, sharding, the guard, the Lion rule), every input
                   check, the plain PyTorch reference, initial weights a unit at a time, and a plan
                   turned into the engine's arguments (engine.parts, engine.arguments)
    data/          bytes, corpora and batches; tokenizers and chat templates; prepare (a corpus
                   tokenized once); outputs put in place whole (publish)
    checkpoints/   checkpoints saved and loaded (checkpoint), their format read without a trainer
    hf/            Hugging Face checkpoints in (hf.load) and out (save_hf; its export command)
    run/           a training run: its directory, lock, stops, exit codes, --nproc-per-node, the
                   learning-rate schedule, the closing sample
    plan/          the memory and throughput planner (and what an aten op costs)
    sim/           proving the schedule on a CPU: recorder, race checker, timeline twin, command
    cli.py         the flags of train.py, the planner and the checker, every default
    prepare.py     `python -m megatrain_min.prepare`, the name it is documented by (data/prepare.py)
    chat.py        `python -m megatrain_min.chat`, the name it is documented by (data/chat.py)
Imports go one way between the packages (tests/core/test_core.py keeps it): engine <- cli <- plan
<- sim; engine <- data <- checkpoints <- hf <- run. Measurements live in bench/, never here.
"""
