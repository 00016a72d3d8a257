"""Checkpoints with orbax: save sharded, restore onto any mesh or strategy, resume exactly.

:func:`save` writes a model (every Variable: parameters, RNG state, batch
statistics), optionally its optimizer and a small JSON ``extra``, with each
process writing its own shards. :func:`restore` reads them into *targets* that
say where every array goes: an abstract model from
:func:`nnx_shard.abstract_init` (and :func:`nnx_shard.sharded_optimizer` on
it), or a concrete model. Each device reads exactly its own slice of each
array from disk, so a checkpoint written by FSDP on 8 devices restores onto
FSDP+TP on 4x2, or onto one device, without the whole model ever passing
through one device. :class:`Checkpointer` saves every N steps in the
background, keeps the last K, and is what ``Trainer.fit(checkpointer=...,
resume=True)`` uses.

One way per use, one implementation behind them (the same checks, the same
errors): a checkpoint by hand is :func:`save` / :func:`restore`; in a training run it
is a :class:`Checkpointer` given to ``Trainer.fit``, whose :meth:`Checkpointer.save`
writes what :func:`save` writes and whose :meth:`Checkpointer.restore` is
:func:`restore`.

On disk, one directory per step, written by orbax's ``CheckpointManager``::

    <directory>/<step>/model/       arrays (tensorstore, zarr in OCDBT)
    <directory>/<step>/optimizer/   arrays (only when an optimizer was saved)
    <directory>/<step>/extra/       JSON
    <directory>/<step>/manifest/    JSON: format, step, per array its shape, dtype
                                    and a checksum of its bits, a hash of extra,
                                    and a digest of all of it
    <directory>/.nnx_shard.lock     held (shared) by every process while it saves

No pickle anywhere. A step is written under a temporary name
(``<step>.orbax-checkpoint-tmp*``) and renamed when complete, so a save killed
half-way never looks like a checkpoint.

What is ours. A folder of ``directory`` is a checkpoint only when its name is a
step number (``12``, not ``012``) and it holds our manifest with its digest and
the files of every item the manifest lists. Anything else there (``1/`` or
``2024/`` of yours, a file named ``3``, a symlink) is never listed, restored,
rotated, written over or deleted; saving a step whose folder exists is refused.
``keep=`` rotation deletes a step by first renaming it to
``<step>.nnx_shard-deleting-*`` (one atomic rename), so a process killed while
deleting leaves no half-deleted step behind, only that folder, which the next
:class:`Checkpointer` removes. The temporary folder of an interrupted save is
removed when a :class:`Checkpointer` is opened only if no process holds the
directory's lock file: every save holds it (shared) while it writes and the
kernel drops it when a process dies, so another process's save in flight is
never deleted. (On a file system without ``flock`` nothing is removed.) Either
folder is removed only when a claim proves it ours: a record
(``.nnx_shard-claim-*.json``) written before the folder was made or renamed,
naming it, its inode and its writer, whose process is gone. A folder merely
named like one (``5.orbax-checkpoint-tmp``, ``7.nnx_shard-deleting-mine``) is
never touched, and a save of a step whose temporary name is taken is refused
(orbax would delete the folder there); orbax's own by-name clean-up of
temporary folders stays off.

What is checked. Orbax's compressed chunks carry no checksum (a flipped byte
decodes to wrong values), hence the manifest: restore recomputes every array's
checksum on the devices and refuses a mismatch. The manifest's digest covers its
entries, the step it was written for (a renamed folder is refused) and a hash of
``extra`` (an edited ``"step"`` or data position is refused, naming the file).
The other files orbax reads (its tree metadata, OCDBT manifests, shardings) only
steer the reading: damage there is a read error or yields arrays that fail their
checksums, never different values. Checkpoints of format 1 (written before the
digest covered ``extra``) still restore, checked as before.

Failures. A background save that fails (disk full, read-only file system) is
raised at the next :meth:`Checkpointer.save`, :meth:`~Checkpointer.wait` or
:meth:`~Checkpointer.close`, as one ``OSError`` naming the step and the cause.
Close a Checkpointer (or use it in a ``with`` block, as ``Trainer.fit`` does)
before the program ends: by the time any exit hook runs, Python has stopped the
thread pools a background save writes with (and Python >= 3.12 starts no new
thread), so a save still in flight then is lost. For a Checkpointer left open, an
``atexit`` callback waits for its save while it makes progress (bytes written;
after ``NNX_SHARD_EXIT_STALL`` seconds, default 60, without any it gives up
instead of hanging) and prints one line on stderr per save that failed, was lost
or stalled. The exit status stays the program's own: Python has no public way to
change it once the program has ended. Orbax logs its own records (through
absl's logger) and tensorstore may report "Event loop is closed" after a failed
read; both are left to the program's logging and hooks, e.g.
``logging.getLogger("absl").setLevel(logging.CRITICAL)``.

Saves to one directory are serialised within a process (threads, several
:class:`Checkpointer` objects): of concurrent saves of the same step exactly
one writes it and the others raise ``FileExistsError``. Processes that save
to one directory must coordinate themselves (multi-process jobs do: every
process takes part in each save).

Typed PRNG keys (``nnx.Rngs`` state) are stored as their ``uint32`` key data
and re-wrapped on restore with the implementation the target's dtype names.
"""

from nnx_shard._checkpoint._checkpointer import Checkpointer
from nnx_shard._checkpoint._restore import restore
from nnx_shard._checkpoint._save import save

__all__ = ["Checkpointer", "restore", "save"]
