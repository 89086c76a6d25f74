"""The emitted training program: one technique per unit, composed by `train.py`.

`plan` copies this package verbatim into `out/program/`, beside `plan.json`, a copy of the model file
and `launch.sh` (backends.torchdist.emit). Everything that differs between plans is read from
`plan.json` at run time; nothing of a spec, a model or a plan is ever written into this code.

    train.py        the entry: its arguments, then the units below in the order a step uses them
    lifeline        die with the launcher (PR_SET_PDEATHSIG): no worker outlives its torchrun agent
    placement       which plan rank this process is (node rank, local rank -> plan rank), checked
                    against the plan: process counts per node, the GPU's type
    process_group   join the process group with that rank; the gradient groups; who is who (Context)
    layout          the rank -> replica / stage / device table the program prints at start-up
    seeds           generator seeds derived from the run's seed (module inits, data order)
    materialise     the model built on meta; only this rank's tensors given values (the init contract)
    weights         pretrained weights: this rank's tensors read from safetensors / Hugging Face / DCP files
    weight_names    which checkpoint name each model tensor is read from (one prefix rewrite, tied aliases)
    rows            the rows of the global batch a replica trains on, cut into its micro-batches
    data            dataset() read through a DataLoader, by the ranks that need its inputs or targets
    stages          the model traced on meta per micro-batch size, split like the plan; this stage installed
    tensor_parallel this rank's shard of the stage: its column/row pairs cut to 1/t, its slice of their weights
    p2p             point-to-point sends and receives between stages, with their message tags
    activations     activation compression on pipeline links (the wire format of each value)
    pipeline        the schedule executor: a stage's 1F1B / GPipe actions, forward and backward
    comm_check      refuse to start unless this rank's communication is the one `plan` verified
    slowdown        emulated slow devices: each compute step padded to the spec's `slowdown`
    precision       autocast per stage and plan-wide fp16 loss scaling
    gradsync        gradient groups: an exact or compressed all-reduce per group
    optimizers      AdamW, SGD, 1-bit Adam, and one step's gradient sync around loss scaling
    zero            optimizer state sharded across a gradient group (ZeroRedundancyOptimizer)
    rebalance       new batch shares when replicas drift (`--rebalance`), verified and applied without a restart
    checkpoint      checkpoint folders: which is complete, which to resume from, pruning
    checkpoint_save saving with DCP, in the background, a save complete once every rank's data is written
    checkpoint_state what a checkpoint holds, by name, and restoring it into a rank of any plan
    checkpoint_reshard a checkpoint of another tensor-parallel degree: the lanes' pieces put together, re-cut
    checkpoint_weights a checkpoint read as the whole model's tensors (--weights; `plan export --safetensors`)
    faults          injected faults for the tests (`--fault`: kill, slow, crash in a save)
    memory          a rank's measured peak memory; the spec's device memory held on CPU ranks; running out in one line
    metrics         one JSON line per step and rank, written whole; `read_metrics` to read them back
    dry_run         a replica's stages built and run once on meta, as its ranks would start (`--dry-run`)

Units import each other relatively (`from . import p2p`) and hetplan's library absolutely
(`backends.compression`, `backends.kernels`, `passes.split`, `planner.frontend`, `planner.core`), so
the copy runs wherever hetplan is installed, as `python -m program.train` from the plan directory or
as `torchrun ... program/train.py`. This file imports nothing: `lifeline` must run before torch loads.
"""
