"""Object stores through obstore: configuration, stores per bucket, uploads, ranged reads, errors.

What the backend of `s3://`, `gs://`, `az://` and `memory://` URLs is
built on. It uses obstore, the Python bindings of the Rust `object_store`
crate (docs/design.md has the measurements that chose it over fsspec and
s3fs), imported only when a URL is first used: `pip install 'jckpt[cloud]'`.

* **Configuration** is each cloud's own: environment variables
  (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
  `AWS_REGION`; `GOOGLE_APPLICATION_CREDENTIALS` or application default
  credentials; `AZURE_STORAGE_ACCOUNT_NAME` ...), and, where a program
  needs more, `configure` for a scheme or a bucket: obstore's options
  (`endpoint`, `region`, `client_options`, `retry_config`, or a
  ready `store`), and jckpt's own `part_size` and `concurrency`. An
  `http://` endpoint (a local S3 server) is allowed without more ado.
* **Writes** are `jckpt.storage.object_uploads`: one PUT, or one multipart
  upload completed at the end, so the object appears whole or not at all.
* **Reads** are ranged: see `jckpt.storage.remote_reader`.
* **The writer lease** is an object created only if absent (a conditional
  PUT): see `jckpt.storage.object_lease`. The backend itself, which
  `backend_for` hands out, is `jckpt.storage.object_backend`.

>>> url = ObjectURL.parse('memory://bucket/run/model.jckpt')
>>> url.bucket, url.key, url.child('x').url
('bucket', 'run/model.jckpt', 'memory://bucket/run/model.jckpt/x')
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

from jckpt.errors import CheckpointError, FormatError, InputError, StorageError

#: URL schemes served here, and the store kind each names.
SCHEMES = {'s3': 's3', 's3a': 's3', 'gs': 'gs', 'gcs': 'gs', 'az': 'az', 'azure': 'az', 'abfs': 'az',
           'abfss': 'az', 'memory': 'memory'}
#: Options of `configure` that are jckpt's own (the rest go to the store).
OWN_OPTIONS = ('part_size', 'concurrency', 'store')
#: The message of the `FormatError` for a URL where no object is stored.
MISSING_OBJECT = "no such checkpoint object"
REMOVED_WHILE_READ = "the object was removed while it was read"
DEFAULT_PART_SIZE = 16 << 20
DEFAULT_CONCURRENCY = 8
#: Where each kind of store finds its credentials, and its endpoint, for errors' fixes.
_CREDENTIALS = {'s3': "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or a profile)",
                'gs': "GOOGLE_APPLICATION_CREDENTIALS or application default credentials",
                'az': "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY (or another "
                      "AZURE_STORAGE_* credential)"}
_ENDPOINTS = {'s3': "the endpoint (AWS_ENDPOINT_URL for S3-compatible servers)",
              'gs': "the endpoint", 'az': "the account and endpoint (AZURE_STORAGE_ENDPOINT)"}


def _credentials_fix(url: str) -> str:
    where = _CREDENTIALS.get(SCHEMES.get(url.partition('://')[0].lower(), ''))
    return (f"check the credentials: {where}, or pass them with jckpt.storage.configure" if where
            else "check the credentials, or pass them with jckpt.storage.configure")


def _network_fix(url: str) -> str:
    where = _ENDPOINTS.get(SCHEMES.get(url.partition('://')[0].lower(), ''), "the endpoint")
    return f"check {where} and the network, then try again"


_LOCK = threading.Lock()
_OPTIONS: dict[str, dict[str, Any]] = {}
_STORES: dict[tuple[str, str], Any] = {}
_MEMORY: dict[str, Any] = {}


@dataclasses.dataclass(frozen=True)
class ObjectURL:
    """A URL split into the store's kind, its bucket and the object key (`url` is kept as given)."""

    url: str
    kind: str
    scheme: str
    bucket: str
    key: str

    @classmethod
    def parse(cls, url: str) -> ObjectURL:
        scheme, _, rest = url.partition(':')
        scheme = scheme.lower()
        bucket, _, key = rest.removeprefix('/').removeprefix('/').partition('/')
        if not bucket:
            raise InputError("the URL names no bucket", file=url,
                             fix=f"write it as {scheme}://BUCKET/path/to/checkpoint")
        if '@' in bucket or ':' in bucket:  # no cloud's bucket names hold either
            _refuse_authority(url, scheme)
        parts = [p for p in key.split('/') if p]
        if any(ord(c) < 32 or c == '\x7f' for c in key):  # stores refuse them, saying "network"
            raise InputError("a URL's path cannot hold control characters (a newline, a tab)",
                             file=url.encode('unicode_escape').decode('ascii'),
                             fix="name the checkpoint with printable characters")
        if '.' in parts or '..' in parts:  # a store takes them literally, or refuses them late
            raise InputError("a URL's path cannot hold '.' or '..' segments", file=url,
                             fix="write the object's key in full, without '.' or '..'")
        return cls(url, SCHEMES[scheme], scheme, bucket, '/'.join(parts))

    def child(self, name: str) -> ObjectURL:
        return ObjectURL.parse(f"{self.scheme}://{self.bucket}/{self.prefix}{name}")

    @property
    def prefix(self) -> str:
        """The key as a directory: what objects "inside" it start with."""
        return f"{self.key}/" if self.key else ''


def _refuse_authority(url: str, scheme: str) -> None:
    """Refuse credentials (`USER:SECRET@`, and a secret may hold `/`) or a `host:port` where
    the bucket goes; nothing before the last `@` is repeated in the message."""
    if '@' in url:
        raise InputError("a URL must not carry credentials (USER:SECRET@BUCKET)",
                         file=f"{scheme}://...@{url.rpartition('@')[2]}",
                         fix="pass credentials in the environment or with jckpt.storage.configure")
    raise InputError("a bucket's name cannot hold ':'", file=url,
                     fix="give an endpoint (host:port) in AWS_ENDPOINT_URL or "
                         "jckpt.storage.configure(scheme, endpoint=...), not in the URL")


def configure(prefix: str, **options: Any) -> None:
    """Options for the stores of URLs that start with `prefix` (a scheme, or `scheme://bucket`).

    For what the environment does not say: the options of obstore's store for
    that cloud (`endpoint`, `region`, `access_key_id`,
    `secret_access_key`, `client_options`, `retry_config`, ...), or a
    ready obstore `store` to use as is; and jckpt's own `part_size` (bytes
    per part of a multipart upload and per ranged GET, default 16 MiB, at least 5 MiB) and
    `concurrency` (requests in flight, default 8). A bucket's options are
    applied over its scheme's. Calling it again replaces the options of that
    prefix; `configure(prefix)` clears them. Process-wide: every entry point
    (`save`, `restore`, the `Mirror`, the `CheckpointManager`, the tools) sees
    them.

    Example:
        ```python
        jckpt.storage.configure("s3", endpoint="http://localhost:9000", region="us-east-1")
        jckpt.storage.configure("s3://big-bucket", part_size=64 << 20, concurrency=16)
        ```
    """
    scheme = prefix.split(':', 1)[0].lower()
    if scheme not in SCHEMES:
        raise InputError(f"no storage backend for URL scheme {scheme!r}", file=prefix,
                         fix=f"configure one of {sorted(SCHEMES)}")
    _check_tuning(options, prefix)
    _check_store_options(prefix, scheme, options)
    key = scheme if '://' not in prefix else f"{scheme}://{ObjectURL.parse(prefix).bucket}"
    with _LOCK:
        if options:
            _OPTIONS[key] = dict(options)
        else:
            _OPTIONS.pop(key, None)
        _STORES.clear()


#: The smallest part S3 accepts in a multipart upload (but the last).
MIN_PART_SIZE = 5 << 20


def _check_tuning(options: dict[str, Any], prefix: str) -> None:
    part, concurrency = options.get('part_size', DEFAULT_PART_SIZE), options.get('concurrency', 1)
    if not isinstance(part, int) or isinstance(part, bool) or part < MIN_PART_SIZE:
        raise InputError(f"part_size must be an integer of at least {MIN_PART_SIZE} bytes (5 MiB, the "
                         f"smallest part S3 takes), not {part!r}", file=prefix)
    if not isinstance(concurrency, int) or isinstance(concurrency, bool) or concurrency < 1:
        raise InputError(f"concurrency must be a positive integer, not {concurrency!r}", file=prefix)


def _check_store_options(prefix: str, scheme: str, options: dict[str, Any]) -> None:
    """Refuse now what obstore refuses of the options themselves (an unknown key, a value of the
    wrong type or form): later, it failed every use of the scheme with a network error's fix.
    A store is built to ask (no request is made); what the environment lacks is left for use."""
    if options.get('store') is not None or SCHEMES[scheme] == 'memory' or not available():
        return
    bucket = ObjectURL.parse(prefix).bucket if '://' in prefix else 'jckpt-configure-check'
    merged = {**_OPTIONS.get(scheme, {}), **options}
    if SCHEMES[scheme] == 's3':
        _s3_endpoint(merged, prefix)
    try:
        _build(ObjectURL.parse(f"{scheme}://{bucket}/x"), merged)
    except CheckpointError as e:
        cause = e.__cause__
        if isinstance(cause, TypeError) or type(cause).__name__ == 'UnknownConfigurationKeyError' \
                or 'Config error' in str(cause):
            raise InputError(f"the store refuses these options: {str(cause).splitlines()[0]}",
                             file=prefix, fix="check the option's name and value against "
                             "obstore's store for this cloud (S3Store, GCSStore, AzureStore)") from None


def forget_stores() -> None:
    """Drop the stores built so far (the next use reads the environment again); memory:// stays."""
    with _LOCK:
        _STORES.clear()


def _settings(u: ObjectURL) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for key in (u.scheme, f"{u.scheme}://{u.bucket}"):
        merged.update(_OPTIONS.get(key, {}))
    return merged


def available() -> bool:
    """Whether obstore is installed (without importing it)."""
    return importlib.util.find_spec('obstore') is not None


def obstore_module() -> Any:
    """The obstore module, imported on first use; an `InputError` saying what to install when missing."""
    try:
        return importlib.import_module('obstore')
    except ImportError:
        raise InputError("reading and writing URLs needs obstore, which is not installed",
                         fix="pip install 'jckpt[cloud]'") from None


def store_for(u: ObjectURL) -> Any:
    """The obstore store of `u`'s bucket, built once per bucket from the environment and `configure`."""
    with _LOCK:
        store = _STORES.get((u.scheme, u.bucket))
        if store is None:
            store = _STORES[(u.scheme, u.bucket)] = _build(u, _settings(u))
        return store


def _build(u: ObjectURL, options: dict[str, Any]) -> Any:
    obs = obstore_module()
    if options.get('store') is not None:
        return options['store']
    if u.kind == 'memory':
        if u.bucket not in _MEMORY:
            _MEMORY[u.bucket] = obs.store.MemoryStore()
        return _MEMORY[u.bucket]
    store_options = {k: v for k, v in options.items() if k not in OWN_OPTIONS}
    if u.kind == 's3':
        endpoint = _s3_endpoint(store_options, u.url)
        if endpoint.startswith('http://'):
            store_options['client_options'] = {'allow_http': True, **store_options.get('client_options', {})}
    root = {'s3': 's3', 'gs': 'gs', 'az': 'az'}[u.kind]
    try:
        return obs.store.from_url(f"{root}://{u.bucket}", **store_options)
    except Exception as e:
        raise store_error(e, "configuring the object store", u.url) from e


#: The names obstore takes for an S3 store's endpoint.
_ENDPOINT_OPTIONS = ('endpoint', 'aws_endpoint', 'aws_endpoint_url', 'endpoint_url')


def _s3_endpoint(options: dict[str, Any], where: str) -> str:
    """The endpoint an S3 store of `options` uses (theirs, else the environment's; '' for
    AWS's own), refused unless an http:// or https:// URL of a host: obstore's client panics
    on one that is not (`localhost:9000`), past any `except Exception`."""
    endpoint = next((str(options[k]) for k in _ENDPOINT_OPTIONS if options.get(k)), '') \
        or os.environ.get('AWS_ENDPOINT_URL_S3') or os.environ.get('AWS_ENDPOINT_URL') \
        or os.environ.get('AWS_ENDPOINT') or ''
    if endpoint and not re.fullmatch(r'https?://(\[[0-9a-fA-F:.]+\]|[^/\s:@\[\]]+)(:[0-9]+)?(/\S*)?',
                                     endpoint):
        raise InputError(f"the S3 endpoint {endpoint!r} is no http:// or https:// URL of a host "
                         "(the store's client panics on one)", file=where,
                         fix="write it as http://HOST:PORT (a local server) or https://HOST, in "
                             "AWS_ENDPOINT_URL or jckpt.storage.configure(..., endpoint=...)")
    return endpoint


def tuning(u: ObjectURL) -> tuple[int, int]:
    """`(part_size, concurrency)` for `u`'s bucket (`configure`'s, else the defaults)."""
    s = _settings(u)
    return int(s.get('part_size', DEFAULT_PART_SIZE)), int(s.get('concurrency', DEFAULT_CONCURRENCY))


def store_error(exc: BaseException, action: str, url: str) -> CheckpointError:
    """An obstore failure as a `CheckpointError` naming the URL and a fix."""
    if isinstance(exc, CheckpointError):
        return exc
    name = type(exc).__name__
    text = str(exc)
    detail = text.splitlines()[0][:200] if text else name
    if _no_bucket(text):
        return StorageError(f"{action} failed: the bucket {_bucket(url)!r} does not exist",
                            file=url, fix=_bucket_fix(url))
    if 'incorrectly configured region' in text or 'AuthorizationHeaderMalformed' in text \
            or 'PermanentRedirect' in text:
        return StorageError(f"{action} failed: the bucket {_bucket(url)!r} is in another region "
                            f"than the one asked ({detail})", file=url, fix=_region_fix(url, text))
    if name == 'PermissionDeniedError' or 'AccessDenied' in text:  # known, but not allowed
        return StorageError(f"{action} failed: access denied ({detail})", file=url,
                            fix=permission_fix(action, url))
    if name == 'UnauthenticatedError' or 'InvalidAccessKeyId' in text \
            or 'SignatureDoesNotMatch' in text:
        return StorageError(f"{action} failed: access denied ({detail})", file=url,
                            fix=_credentials_fix(url))
    # no keys in the environment: the store asked the cloud's instance metadata service
    metadata_service = '169.254.169.254' in text or 'metadata.google.internal' in text
    lower = text.lower()
    if 'credential' in lower or 'service account' in lower or 'account must be specified' in lower \
            or metadata_service:
        return StorageError(f"{action} failed: the credentials could not be loaded ({detail})",
                            file=url, fix=_credentials_fix(url))
    if name == 'UnknownConfigurationKeyError':
        return InputError(f"{action} failed: {detail}", file=url,
                          fix="see obstore's options for this store; jckpt's own are "
                              + ", ".join(OWN_OPTIONS))
    busy = _server_refused(text, action, url)
    if busy is not None:
        return busy
    if name == 'PreconditionError':
        return StorageError(f"{action} failed: the object changed while it was read", file=url,
                            fix="another writer replaced it; read it again")
    return StorageError(f"{action} failed: {detail}", file=url, fix=_network_fix(url))


def _server_refused(text: str, action: str, url: str) -> StorageError | None:
    """The error of a request the store kept answering with a 5xx or 429 through the retries
    (obstore's `retry_config`, by default up to 10 within 180 s): throttling (503 Slow Down,
    429) is said as such, with how to ask less at once; the fix was to check the network.

    >>> e = _server_refused("Error performing GET ... after 2 retries, max_retries: 2 - Server "
    ...                     "returned non-2xx status code: 503 Service Unavailable", "reading", "s3://b/m")
    >>> e.message
    'reading failed: the store answered 503 (it is throttling requests: Slow Down) after 2 retries'
    """
    code = re.search(r"status code: ([45][0-9][0-9])", text)
    if code is None or not (code[1] in ('429', '503') or code[1].startswith('5')):
        return None
    said = re.search(r"after ([0-9]+) retries", text)
    tries = f" after {said[1]} retries" if said else ""
    bucket = f"{url.partition('://')[0]}://{_bucket(url)}"
    retry = (f"allow more retries: jckpt.storage.configure({bucket!r}, "
             "retry_config={'max_retries': 10, 'retry_timeout': timedelta(minutes=5)})")
    if code[1] in ('429', '503'):
        return StorageError(f"{action} failed: the store answered {code[1]} (it is throttling requests: "
                            f"Slow Down){tries}", file=url,
                            fix=f"try again later, make fewer requests at once (configure's concurrency, "
                                f"8 by default), or {retry}")
    return StorageError(f"{action} failed: the store answered {code[1]} (a server error){tries}",
                        file=url, fix=f"try again later, or {retry}; if it persists, {_network_fix(url)}")


#: The S3 IAM actions each kind of request needs, by the start of its action's words.
_S3_ACTIONS = (
    ('uploading', "s3:PutObject (a multipart upload, above part_size, also "
                  "s3:AbortMultipartUpload, and its marker s3:ListBucket, "
                  "s3:ListBucketMultipartUploads, s3:GetObject and s3:DeleteObject)"),
    ('taking the writer lease', "s3:PutObject, s3:GetObject and s3:DeleteObject"),
    ('reading', "s3:GetObject (and s3:ListBucket: without it a missing object is denied, "
                "not reported missing)"),
    ('looking up', "s3:GetObject and s3:ListBucket"),
    ('listing', "s3:ListBucket"),
    ('deleting', "s3:DeleteObject"),
    ('aborting', "s3:AbortMultipartUpload"))
#: What a writer (a save, a Mirror, a CheckpointManager) needs on S3, all together.
S3_WRITER_ACTIONS = ("s3:GetObject, s3:PutObject, s3:DeleteObject, s3:ListBucket, "
                     "s3:ListBucketMultipartUploads and s3:AbortMultipartUpload")
#: The roles that grant what jckpt asks of GCS and Azure: to read, and to write.
_ROLES = {'gs': "roles/storage.objectViewer (to read) or roles/storage.objectUser (to write)",
          'az': "Storage Blob Data Reader (to read) or Storage Blob Data Contributor (to write)"}


def permission_fix(action: str, url: str) -> str:
    """The fix of a request the store refused to credentials it knows (AccessDenied): the
    permissions `action` needs (S3's IAM actions; GCS's and Azure's roles) on `url`'s bucket.

    >>> permission_fix("listing", "s3://b/run")[:64]
    'allow s3:ListBucket on arn:aws:s3:::b and arn:aws:s3:::b/* in th'
    """
    kind, bucket = SCHEMES.get(url.partition('://')[0].lower(), ''), _bucket(url)
    if kind == 's3':
        needed = next((n for start, n in _S3_ACTIONS if action.startswith(start)), S3_WRITER_ACTIONS)
        return (f"allow {needed} on arn:aws:s3:::{bucket} and arn:aws:s3:::{bucket}/* in the IAM "
                f"policy of the user or role whose credentials are used (a writer needs "
                f"{S3_WRITER_ACTIONS}), or {_credentials_fix(url)}")
    if kind in _ROLES:
        return f"grant {_ROLES[kind]} on the bucket {bucket!r}, or {_credentials_fix(url)}"
    return _credentials_fix(url)


def _region_fix(url: str, text: str) -> str:
    """The fix of a request sent to the wrong region: the bucket's own, where the error says it.

    >>> _region_fix('s3://b/x', "the region 'us-east-1' is wrong; expecting 'eu-west-1'")[:53]
    "set the bucket's region (it is eu-west-1): AWS_REGION"
    """
    said = re.search(r"expecting '([a-z0-9-]+)'", text)
    region = said[1] if said else 'REGION'
    where = f"it is {region}" if said else f"aws s3api get-bucket-location --bucket {_bucket(url)} tells it"
    bucket = f"{url.partition('://')[0]}://{_bucket(url)}"
    return (f"set the bucket's region ({where}): AWS_REGION={region}, or "
            f"jckpt.storage.configure({bucket!r}, region={region!r})")


def is_missing(exc: BaseException) -> bool:
    """Whether `exc` says an object is not there (a missing bucket is an error of its own)."""
    return isinstance(exc, FileNotFoundError) and not _no_bucket(str(exc))


def _no_bucket(text: str) -> bool:
    """Whether a store's error says the bucket (an Azure container) does not exist."""
    return 'NoSuchBucket' in text or 'ContainerNotFound' in text \
        or 'bucket does not exist' in text.lower()


def _bucket(url: str) -> str:
    return url.partition('://')[2].partition('/')[0]


#: How each kind of store's bucket is created, for the fix of a missing one.
_CREATE = {'s3': "aws s3 mb s3://{}", 'gs': "gcloud storage buckets create gs://{}",
           'az': "az storage container create --name {}"}


def _bucket_fix(url: str) -> str:
    """The fix of a missing bucket: create it, or check where the URL leads."""
    kind = SCHEMES.get(url.partition('://')[0].lower(), '')
    create = f" ({_CREATE[kind].format(_bucket(url))})" if kind in _CREATE else ''
    return (f"create the bucket{create}, or check the URL, {_ENDPOINTS.get(kind, 'the endpoint')} "
            "and the credentials (another server or account may not have the bucket)")


class ObjectSource:
    """One object, read by ranges (a `RangeSource` of `jckpt.storage.remote_reader`)."""

    def __init__(self, u: ObjectURL) -> None:
        self.u, self.store, self.obs = u, store_for(u), obstore_module()

    def head(self, length: int) -> tuple[bytes, int, str | None]:
        try:
            result = self.obs.get(self.store, self.u.key, options={'range': (0, length)})
            meta = result.meta
            return bytes(result.bytes()), meta['size'], meta.get('e_tag')
        except Exception as e:
            if is_missing(e):
                raise FormatError(MISSING_OBJECT, file=self.u.url,
                                  fix="check the URL, or save a checkpoint there first") from None
            try:  # an empty object has no range to read
                meta = self.obs.head(self.store, self.u.key)
            except Exception:
                raise store_error(e, "reading the checkpoint", self.u.url) from e
            if meta['size']:
                raise store_error(e, "reading the checkpoint", self.u.url) from e
            return b'', 0, meta.get('e_tag')

    def read_into(self, dest: memoryview, offset: int, version: str | None) -> None:
        options: dict[str, Any] = {'range': (offset, offset + len(dest))}
        if version:
            options['if_match'] = version
        try:
            data = self.obs.get(self.store, self.u.key, options=options).bytes()
        except Exception as e:
            if is_missing(e):
                raise StorageError(REMOVED_WHILE_READ, file=self.u.url,
                                   fix="another writer removed it; read a checkpoint that exists") from None
            raise store_error(e, "reading the checkpoint", self.u.url) from e
        if len(data) != len(dest):
            raise FormatError(f"object ended early: {len(data)} bytes at offset {offset}, expected "
                              f"{len(dest)}", file=self.u.url, fix="the object is truncated")
        dest[:] = memoryview(data)


@contextlib.contextmanager
def pieces_replaced() -> Iterator[None]:
    """Say of a directory checkpoint's piece removed while it was read that the checkpoint was
    replaced (a `FormatError`: open it again), as of one gone before it was opened."""
    try:
        yield
    except StorageError as e:
        if e.message != REMOVED_WHILE_READ:
            raise
        raise FormatError(f"piece file {e.file.rsplit('/', 1)[-1]}, which the index names, is "
                          "gone: the checkpoint was replaced (or removed) after its index was "
                          "read", file=e.file, fix="open the checkpoint again to read the one "
                                                   "there now") from None


__all__ = ['MISSING_OBJECT', 'REMOVED_WHILE_READ', 'SCHEMES', 'ObjectSource', 'ObjectURL', 'available',
           'configure', 'permission_fix', 'pieces_replaced',
           'forget_stores', 'is_missing', 'obstore_module', 'store_error', 'store_for', 'tuning']
