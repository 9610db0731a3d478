"""The wire protocol: what the rank workers, the host agents and the fan-out say to each other.

Modules: ``addrs`` (the store's keys, ``WorkerAddr``, ``Registry``, ``NOT_REGISTERED``, the
agent's key and rank lists), ``names`` (every handler and parameter name below, as constants: no module spells them
as literals), ``wire`` (the two routes, the stacks separator, ``HandlerError``), ``agentwire``
(the agent's routes and parameters), ``frwindow`` (windows: which FR entries a page needs),
``frtext`` (cutting c10d's ring text to a window), ``activecover`` (an ``onlyactive`` reply read
as a cut), ``members`` (member lists sent once: ``pgknown``), ``fastjson`` (JSON by ``orjson``
where installed, the same values as ``json``). Pure: no torch, no recording.

**Routes.** Workers (``rank.worker``) and agents (``agent.app``) serve the paths of torch's C++
``WorkerServer``: ``GET /handler/`` lists the handler names as JSON; ``POST
/handler/<name>?<params>`` runs one. Unknown name: 404; unknown or bad parameter: 400 with one
line naming it; with a job token every request carries ``X-Debug-Server-Token``.

Worker handlers (sent by the fan-out: ``fanout.live``, ``fanout.rounds``, ``fanout.c10d_round``,
the frontend's pages; by an agent's own fan-out for its host's ranks):

=========================== =========================================================== =========
handler                     reply                                                        params
=========================== =========================================================== =========
``torchcomms_fr_trace_json`` this rank's FR dump (JSON); ``stacks=true``: then            FR, ``stacks``
                            ``STACKS_SEP`` (``"\\n\\x1e"``) and the stacks text
``fr_trace_json``           c10d's own recorder (ours: cut to ``window``/``since``;      FR
                            torch's C++ worker: its CPU recorder, whole whatever asked)
``dump_nccl_trace_json``    torch's C++ worker only: its NCCL recorder                   ``onlyactive``
``dump_traceback``          this rank's Python stacks (text)                              none
``ping``                    ``pong``                                                       none
``torchcomms_health_check`` this rank's health (JSON)                                     none
``torchcomms_fr_dump_file`` writes this rank's FR pickle; JSON ``path``, ``host``         none
``pyspy_dump``              py-spy of this rank or, ``pid=``, of a rank of the job on     py-spy
                            its host
``process_state``           this rank's process (or, ``pid=``, a rank of the job on its   ``pid``
                            host) read from ``/proc``: state, since, CPU, wchan (JSON)
``torch_profile``           a profile of ``duration`` seconds                             ``duration``
``wait_counter_values``     torch's wait counters                                         none
=========================== =========================================================== =========

Query parameters (sender -> reader):

===================== =========================================================================
parameter             meaning; who sends it; who reads it
===================== =========================================================================
``onlyactive``        FR: only entries not yet completed (torch's); ``fanout`` (whole rings:
                      ``false``; c10d's NCCL recorder in round 1: ``true``), agent's ``agent_fr``
                      -> worker ``_fr_args``, torch's C++ worker
``includecollectives`` FR: ``false`` leaves collectives out (torch's); the straggler clock round
                      (``fanout.recent``) -> worker
``includestacktraces`` FR: ``false``: entries without their frames (torch's); the straggler poll
                      (``LiveCollector.fr_recent``) -> worker
``window``            FR: each group from this rank's own frontier less N ops (ours); fanout
                      round 1 (``frwindow.LOCAL_SLACK``), ``fr_recent`` -> worker ``_cut_arg``;
                      frontend -> ``agent_fr``
``since``             FR: ``{"<group>": <seq>}``, each group from that seq on (ours,
                      ``frwindow.format_since``); fanout round 2 -> worker, ``agent_fr``
``pgknown``           FR: digests of the member lists the asker holds, sent back as references
                      (``members.PARAM``); fanout -> worker, frontend -> ``agent_fr``
``stacks``            FR: ``true``: the stacks follow the FR JSON (``names.WITH_STACKS``);
                      fanout (``fr_stacks``) -> ``torchcomms_fr_trace_json``, ``agent_fr``
``native``            py-spy with native frames; ``readers.pyspy`` -> ``pyspy_dump``; frontend
                      -> ``agent_stacks`` (every rank read that way)
``nonblocking``       py-spy without pausing the rank (torch's frontend sends it); ``readers.pyspy``
                      -> ``pyspy_dump``
``subprocesses``      py-spy of the rank's child processes too; -> ``pyspy_dump``
``pid``               ``pyspy_dump``/``process_state`` of another announced rank on the
                      worker's host (``readers.jobpids``); ``readers.pyspy``, ``fanout.live`` -> worker
``duration``          seconds of ``torch_profile``; frontend ``/profile`` -> worker
``ranks``             agent routes: the ranks asked (``0-3,5``); ``fanout.agents`` -> agent
``whole``             ``agent_fr``: whole rings; ``fanout.agents`` -> agent
``tag``               ``agent_fr``: the asker's last reply's tag (conditional ask,
                      ``agentwire.TAG``); ``fanout.agents`` -> agent
``handler``           ``agent_fetch``: the worker handler to relay (``agentwire.FETCHABLE``)
``every``             ``agent_stacks``: py-spy for every rank, not only the stuck ones
``clock``             ``agent_recent``: ``true``: only the agent's clock; ``fanout.recent`` -> agent
``ops``               ``agent_recent``: newest collectives per group of each rank (1-4096);
                      ``fanout.recent`` -> agent
===================== =========================================================================

Agent routes (``protocol.agentwire``; sent by ``fanout.agents.AgentRoute``, answered by
``agent.app``, read back by ``fanout.agentreply``): ``agent_fr`` (``ranks``, ``window`` or
``since`` or ``whole``/``onlyactive``, ``pgknown``, ``tag``, ``stacks``), ``agent_stacks``
(``ranks``, ``native``, ``every``), ``agent_fetch`` (``ranks``, ``handler``), ``agent_recent``
(``clock``, or ``ranks`` and ``ops``: the straggler poll's read, sent and read back by
``fanout.recent``), ``agent_info`` (none).

**The stacks separator.** A ``stacks=true`` reply is the FR JSON, ``wire.STACKS_SEP``
(``"\\n\\x1e"``), then the stacks text; JSON escapes every control character, so the first
``\\x1e`` is always the separator (``wire.split_stacks``).
"""
