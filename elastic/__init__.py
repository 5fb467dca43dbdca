"""Pure decisions, importable without Ray or torch: functions take values and return decisions.

    spec.py        MeshSpec: the parallel degrees, ranks and replica groups, validated
    policy.py      failure and scaling policies -> Continue / Shrink / Grow / Reshape /
                   RestoreFromCheckpoint / Fail
    planner.py     the mesh for a model on a cluster; cost_model.py (with memory_model.py,
                   layer_traffic.py, pipeline_cost.py) and hardware.py behind it;
                   plan_check.py prices one given layout, plan_explain.py says why
    placement.py   which node each replica group goes to
    straggler.py   which ranks compute persistently slower than their peers, and what to do
    simulator.py   goodput of the recovery policies over a failure trace

Imports nothing of meshpilot's but its own modules and plain-value spec modules (``workers.spec``
for a model's shape).
"""
