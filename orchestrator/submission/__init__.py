"""Running a job on an existing Ray cluster as a Ray job: everything ``meshpilot submit`` and
``meshpilot jobs`` do besides parsing their flags (that is ``orchestrator/cli/submit.py``).

Runs on the user's machine, never on the cluster; it talks to the head's dashboard through
Ray's Job Submission SDK.

    packaging.py   what is sent, checked before the cluster is contacted: the working directory's
                   excludes, the entrypoint and its --set overrides, job names, submission ids
    client.py      the dashboard: address resolution, the SDK client with Ray's errors turned into
                   one-line UserErrors, following logs and waiting for a job to end
    auth.py        the bearer token of a token-protected cluster, registered for redaction

May import ``orchestrator.config``/``config_checks``, ``orchestrator.errors``,
``orchestrator.observe.redact`` and the driver's Ray fence (``orchestrator.driver.ray_compat``,
for the token loader); never the controller, the worker group or anything that starts Ray. Ray,
its SDK and ``requests`` are imported inside the functions that need them, so the CLI starts without them.
"""
