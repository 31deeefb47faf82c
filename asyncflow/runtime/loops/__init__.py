"""A worker's loops, for the runtime and the simulator.

The loop state, the op handlers, a train step's reads and the rules a loop applies (the publish
rule, the micro-batch split, cancelling hopeless samples, settling a lease in flight, the step
report) are written once, here; the simulator's workers are hosts of the same
:class:`~asyncflow.runtime.loops.state.Loop` and call them. The control flow between them is
written once too, as generators that yield what they wait for
(:mod:`~asyncflow.runtime.loops.flow`): the real host performs each request at once, blocking
(``loop_batches``, ``loop_train``), the simulator turns each into an event
(:mod:`asyncflow.simulate.workers`). The ``serve`` loop, which its engine drives, is written
once as the engine's two callbacks (``serve(pull, emit)``: :mod:`~asyncflow.runtime.loops.serve`):
the real host hands them to its engine, the simulator's ``ServeWorker`` is a simulated engine
that calls them from its event queue.

==================  ==============================================================================
module              what it holds
==================  ==============================================================================
``flow``            the loops' control flow as generators of requests (a device call, a read
                    that may find nothing, new weights), and the real-time driver
``state``           :class:`~asyncflow.runtime.loops.state.Loop`: one task replica's loop state
                    (gate, windows, bindings, op list) built from its WorkerPlan, the ``batches``
                    and ``train`` loops, and the host hooks with their defaults
``ops``             the op handlers: WAIT, ADOPT, READ, COMPUTE, WRITE, PUBLISH, end of a step
``serve``           the ``serve`` loop (continuous batching): the engine's ``pull`` and
                    ``emit`` callbacks, cancelling samples in flight, writing finished ones,
                    settling a lease in flight; the same for both hosts
``step_reads``      a train step's reads: windows, first_ready, redundancy, followers, gate
                    rule 4, micro-batches
``host``            :class:`~asyncflow.runtime.loops.host.Host`: what a loop asks of its host
==================  ==============================================================================

Hosts: :class:`asyncflow.runtime.worker.Worker` (a thread of the local backend or of a Ray
actor, real time: heartbeat, faults, engine start, liveness, the control plane) and the
simulator's workers (:mod:`asyncflow.simulate.core`, virtual time: device time is an event, the
control plane is instant).
"""
from asyncflow.runtime.loops.host import Host
from asyncflow.runtime.loops.state import Loop, body

__all__ = ["Host", "Loop", "body"]
