"""What every stage runs on: ``parallel`` (torch.distributed and FSDP2: ranks, sharding, collectives; the only
module that touches process groups), ``watchdog`` (the phase each rank is in; a hung phase named), ``memory``
(each phase's peak memory), ``libraries`` (the libraries' own logging, and whether an error came from inside one)
and ``files`` (file modes; the error for a file that cannot be loaded)."""
