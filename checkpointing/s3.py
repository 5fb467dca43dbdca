"""``S3Storage``: the storage protocol on any S3-compatible endpoint, through boto3.

Runs on the ranks (streaming uploads, ranged GETs) and on the driver (commit, listing,
retention, CLI). Credentials come from the standard AWS chain only (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, instance roles); transient failures are retried by
botocore's own ``standard`` retry mode. Uploads stream: the caller's pieces are cut into parts of
``part_size`` bytes and at most ``concurrency`` parts are in flight, so memory stays bounded and
nothing touches a temporary file. The commit is ``put_object(IfNoneMatch="*")``; a refused
conditional complete leaves the upload open, so it is aborted (FACTS.md).
"""

from __future__ import annotations

import builtins  # in the class body below, `list` is the method: later annotations say builtins.list
import threading
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

from checkpointing.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    StorageAccessError,
    StorageCredentialsError,
    StorageNotFoundError,
    StorageUnreachableError,
)
from checkpointing.storage import DEFAULT_CONCURRENCY, DEFAULT_PART_SIZE, Buffer, ObjectInfo, PendingUpload, split_parts

if TYPE_CHECKING:  # botocore is imported where an error is translated
    from botocore.exceptions import ClientError

_MIN_PART = 5 << 20  # S3's smallest part (all but the last)
_MAX_PARTS = 10000
_CREDENTIAL_CODES = {
    "InvalidAccessKeyId": "the access key is not known to {endpoint}",
    "SignatureDoesNotMatch": "the secret key does not match the access key at {endpoint}",
    "InvalidToken": "the session token was refused by {endpoint}",
    "ExpiredToken": "the session token has expired",
    "AccessDenied": "access to {where} was denied: the key lacks permission for {action}",
    "403": "access to {where} was denied ({action}): wrong credentials or missing permission",
}
_CREDENTIAL_FIX = "; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) to a key pair the server accepts"


class S3Storage:
    """Objects under ``s3://bucket/prefix``; keys are relative to the prefix."""

    def __init__(
        self,
        *,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        part_size: int = DEFAULT_PART_SIZE,
        concurrency: int = DEFAULT_CONCURRENCY,
        max_attempts: int = 5,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 60.0,
    ) -> None:
        import boto3
        from botocore.config import Config

        if part_size < _MIN_PART:
            raise CheckpointError(f"checkpoint.part_size_mb: S3 parts must be at least 5 MiB, got {part_size} bytes")
        if concurrency < 1:
            raise CheckpointError(f"checkpoint.upload_concurrency must be >= 1, got {concurrency}")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.endpoint_url = endpoint_url
        self.part_size = part_size
        self.concurrency = concurrency
        config = Config(
            region_name=region,
            retries={"mode": "standard", "max_attempts": max_attempts},
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            max_pool_connections=max(10, 2 * concurrency),
            # Path-style addressing works on every S3-compatible server; AWS itself accepts it.
            s3={"addressing_style": "path"} if endpoint_url else {},
        )
        self._session = boto3.session.Session()
        self._client = self._session.client("s3", endpoint_url=endpoint_url, config=config)
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="meshpilot-s3-part")
        self._pool_lock = threading.Lock()

    # ------------------------------------------------------------------ keys
    def _full(self, key: str) -> str:
        if not key or key.startswith("/"):
            raise CheckpointError(f"invalid object key {key!r}")
        return f"{self.prefix}/{key}" if self.prefix else key

    def _relative(self, full_key: str) -> str:
        return full_key[len(self.prefix) + 1 :] if self.prefix else full_key

    def _where(self, key: str | None = None) -> str:
        return f"s3://{self.bucket}/{self._full(key)}" if key else self.uri

    # ---------------------------------------------------------------- writes
    def put_stream(self, key: str, pieces: Iterable[Buffer], *, size: int | None = None) -> int:
        part_size = self.part_size
        if size is not None and size > part_size * _MAX_PARTS:
            part_size = -(-size // _MAX_PARTS)  # keep within S3's 10,000 parts
        parts = split_parts(pieces, part_size)
        first = next(parts, None)
        second = next(parts, None) if first is not None else None
        if second is None:  # one part: a single PUT is cheaper than a multipart upload
            body = bytes(first) if first is not None else b""
            self._call("PutObject", key, Bucket=self.bucket, Key=self._full(key), Body=body)
            return len(body)
        return self._multipart(key, _chain(first, second, parts))

    def _multipart(self, key: str, parts: Iterable[memoryview]) -> int:
        full_key = self._full(key)
        upload_id = self._call("CreateMultipartUpload", key, Bucket=self.bucket, Key=full_key)["UploadId"]
        in_flight: set[Future] = set()
        etags: dict[int, str] = {}
        total = 0
        try:
            for number, part in enumerate(parts, start=1):
                if len(in_flight) >= self.concurrency:  # back-pressure: bounded memory
                    done, in_flight = wait(in_flight, return_when=FIRST_COMPLETED)
                    for future in done:
                        future.result()
                body = bytes(part)  # botocore takes bytes or files, not memoryviews
                total += len(body)
                in_flight.add(self._pool.submit(self._upload_part, key, full_key, upload_id, number, body, etags))
            for future in in_flight:
                future.result()
            in_flight = set()
            self._call(
                "CompleteMultipartUpload",
                key,
                Bucket=self.bucket,
                Key=full_key,
                UploadId=upload_id,
                MultipartUpload={"Parts": [{"PartNumber": n, "ETag": etags[n]} for n in sorted(etags)]},
            )
        except BaseException:
            for future in in_flight:
                future.cancel()
            wait(in_flight)
            self._abort(full_key, upload_id)
            raise
        return total

    def _upload_part(
        self, key: str, full_key: str, upload_id: str, number: int, body: bytes, etags: dict[int, str]
    ) -> None:
        answer = self._call(
            "UploadPart", key, Bucket=self.bucket, Key=full_key, UploadId=upload_id, PartNumber=number, Body=body
        )
        etags[number] = answer["ETag"]

    def _abort(self, full_key: str, upload_id: str) -> None:
        try:
            self._client.abort_multipart_upload(Bucket=self.bucket, Key=full_key, UploadId=upload_id)
        except Exception:  # noqa: BLE001 - best effort; retention aborts what is left
            pass

    def put_bytes(self, key: str, data: Buffer) -> None:
        self._call("PutObject", key, Bucket=self.bucket, Key=self._full(key), Body=bytes(data))

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        from botocore.exceptions import ClientError

        try:
            self._client.put_object(Bucket=self.bucket, Key=self._full(key), Body=bytes(data), IfNoneMatch="*")
        except ClientError as error:
            if _code(error) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                return False
            raise self._translate(error, "PutObject", key) from None
        except Exception as error:  # noqa: BLE001 - translated to the storage's one clear error
            raise self._translate(error, "PutObject", key) from None
        return True

    # ----------------------------------------------------------------- reads
    def get_range(self, key: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        answer = self._call("GetObject", key, Bucket=self.bucket, Key=self._full(key), Range=f"bytes={start}-{end - 1}")
        data = answer["Body"].read()
        if len(data) != end - start:
            from checkpointing.errors import CorruptCheckpointError

            raise CorruptCheckpointError(
                f"object {self._where(key)} is shorter than expected: asked for bytes "
                f"[{start}, {end}), got {len(data)}",
                key=key,
            )
        return data

    def get(self, key: str) -> bytes:
        return self._call("GetObject", key, Bucket=self.bucket, Key=self._full(key))["Body"].read()

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self._client.head_object(Bucket=self.bucket, Key=self._full(key))
        except ClientError as error:
            if _code(error) in ("404", "NoSuchKey", "NotFound"):
                self.check_access()  # a missing bucket also answers 404: say which it is
                return False
            raise self._translate(error, "HeadObject", key) from None
        except Exception as error:  # noqa: BLE001 - translated to the storage's one clear error
            raise self._translate(error, "HeadObject", key) from None
        return True

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        full_prefix = f"{self.prefix}/{prefix}" if self.prefix else prefix
        found = []
        paginator = self._client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full_prefix):
                for entry in page.get("Contents", []):
                    found.append(ObjectInfo(key=self._relative(entry["Key"]), size=int(entry["Size"])))
        except Exception as error:  # noqa: BLE001 - translated to the storage's one clear error
            raise self._translate(error, "ListObjectsV2", prefix or None) from None
        return sorted(found, key=lambda info: info.key)

    # -------------------------------------------------------------- deletion
    def delete(self, keys: Iterable[str]) -> None:
        full_keys = [self._full(key) for key in keys]
        for start in range(0, len(full_keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": key} for key in full_keys[start : start + 1000]]
            answer = self._call("DeleteObjects", None, Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            if answer.get("Errors"):
                first = answer["Errors"][0]
                raise StorageAccessError(
                    f"could not delete s3://{self.bucket}/{first.get('Key')}: "
                    f"{first.get('Code')} {first.get('Message')}"
                )

    def list_pending_uploads(self, prefix: str = "") -> builtins.list[PendingUpload]:
        full_prefix = f"{self.prefix}/{prefix}" if self.prefix else prefix
        pending = []
        paginator = self._client.get_paginator("list_multipart_uploads")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full_prefix):
                for upload in page.get("Uploads", []):
                    pending.append(
                        PendingUpload(
                            key=self._relative(upload["Key"]),
                            upload_id=upload["UploadId"],
                            initiated=upload["Initiated"].timestamp(),
                        )
                    )
        except Exception as error:  # noqa: BLE001 - translated to the storage's one clear error
            raise self._translate(error, "ListMultipartUploads", prefix or None) from None
        return sorted(pending, key=lambda upload: (upload.key, upload.initiated))

    def abort_pending_upload(self, upload: PendingUpload) -> None:
        self._call(
            "AbortMultipartUpload",
            upload.key,
            Bucket=self.bucket,
            Key=self._full(upload.key),
            UploadId=upload.upload_id,
        )

    # ------------------------------------------------------------------ misc
    def check_access(self) -> None:
        self._call("HeadBucket", None, Bucket=self.bucket)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    def __repr__(self) -> str:
        return f"S3Storage({self.uri!r}, endpoint_url={self.endpoint_url!r})"

    # ---------------------------------------------------------------- errors
    def _call(self, operation: str, key: str | None, **kwargs):
        method = getattr(self._client, _snake(operation))
        try:
            return method(**kwargs)
        except Exception as error:  # noqa: BLE001 - translated to the storage's one clear error
            raise self._translate(error, operation, key) from None

    def _translate(self, error: Exception, operation: str, key: str | None) -> CheckpointError:
        """One clear sentence per failure kind; never a credential, never the server's echo of one."""
        from botocore.exceptions import (
            ClientError,
            ConnectionClosedError,
            ConnectTimeoutError,
            EndpointConnectionError,
            NoCredentialsError,
            PartialCredentialsError,
            ReadTimeoutError,
        )

        endpoint = self.endpoint_url or "the AWS S3 endpoint"
        where = self._where(key)
        if isinstance(error, CheckpointError):
            return error
        if isinstance(error, (NoCredentialsError, PartialCredentialsError)):
            return StorageCredentialsError(f"no complete AWS credentials found for {self.uri}" + _CREDENTIAL_FIX)
        if isinstance(error, (EndpointConnectionError, ConnectTimeoutError, ConnectionClosedError)):
            return StorageUnreachableError(
                f"cannot reach the S3 endpoint {endpoint} for {self.uri}: check checkpoint.endpoint_url "
                "(or --endpoint-url) and that the server is running"
            )
        if isinstance(error, ReadTimeoutError):
            return StorageUnreachableError(
                f"the S3 endpoint {endpoint} stopped answering during {operation} "
                f"of {where}; retry, or check the server"
            )
        if isinstance(error, ClientError):
            return self._translate_refusal(error, operation, where, endpoint)
        return StorageAccessError(f"S3 {operation} of {where} failed: {type(error).__name__}")

    def _translate_refusal(self, error: ClientError, operation: str, where: str, endpoint: str) -> CheckpointError:
        """The server answered with an error code (botocore's ``ClientError``): a missing bucket or
        object, refused credentials, or another code named with its HTTP status."""
        code = _code(error)
        if code in ("NoSuchBucket",) or (operation == "HeadBucket" and code in ("404", "NotFound")):
            return StorageNotFoundError(
                f"bucket {self.bucket!r} does not exist at {endpoint}: create it, or fix the bucket in checkpoint.uri"
            )
        if code in _CREDENTIAL_CODES:
            text = _CREDENTIAL_CODES[code].format(endpoint=endpoint, where=where, action=operation)
            return StorageCredentialsError(f"S3 refused {operation} on {where}: {text}" + _CREDENTIAL_FIX)
        if code in ("NoSuchKey", "404", "NotFound"):
            return CheckpointNotFoundError(f"no object {where}")
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return StorageAccessError(f"S3 {operation} of {where} failed: {code} (HTTP {status})")


def _code(error) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))


def _snake(operation: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in operation).lstrip("_")


def _chain(first, second, rest):
    yield first
    yield second
    yield from rest
