"""Tensor parallelism: one worker process per rank, the scheduler and all block bookkeeping in
the driver (the engine's process).

    driver (engine process)                          rank r (worker process, one GPU or CPU)
    Scheduler, KVCacheManager, CPU/NVMe bookkeeping  model shard, its KV heads of every GPU block,
    Workers ──── StepPlan (batch, tables, ─────────► its CPU tier slice (shared memory), its
           ◄──── transfers to start) / StepReply     transfer engine; rank 0 draws tokens

Modules: `plan` (the messages), `ranks` (starting the processes, calls, a rank dying), `worker`
(a rank's process), `workers` (the driver's model runner), `transfers` (the driver's transfer
engine), `sharded_tiers` (the CPU tier in shared memory and one NVMe store per rank),
`sharded_remote` (the remote tier: one key per rank and block).
"""
