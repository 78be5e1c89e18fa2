"""The S3 calls obstore lacks, through botocore: listing and aborting multipart uploads.

obstore (`jckpt.storage.object_store`) uploads, reads and lists objects, but
cannot list a bucket's incomplete multipart uploads nor abort one by its
upload id, and lists only by whole path segments (`a/b` is no prefix of
`a/bc`). `jckpt.storage.upload_markers` needs all three to find and abort
the uploads of a killed writer, so for `s3://` URLs this module makes them
with botocore, the core of the AWS SDK (`pip install 'jckpt[cloud]'`
installs it), imported only when a multipart upload starts.

The client is built from the configuration obstore's store of that bucket
uses: the options given to `jckpt.storage.configure` (obstore keeps them,
under their canonical names, as the store's `config`: `endpoint`,
`access_key_id`, `secret_access_key`, `session_token`, `region`, ...) over
the environment (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`); without keys,
botocore's own chain (a profile, a role) applies. Without botocore, one log
line says that incomplete uploads cannot be found and `api_for` gives
`None`: nothing fails for it.

>>> settings_of({'endpoint': 'http://localhost:9000', 'region': 'eu-west-1'}, {}).region
'eu-west-1'
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import logging
import os
import re
import threading
from collections.abc import Mapping
from typing import Any

from jckpt.storage.object_store import ObjectURL

log = logging.getLogger('jckpt')

#: Keys a listing returns at most in one request (S3's page size).
PAGE = 1000
_LOCK = threading.Lock()
_CLIENTS: dict[S3Settings, Any] = {}
_WARNED: list[bool] = []


@dataclasses.dataclass(frozen=True)
class S3Settings:
    """Where and as whom botocore connects: obstore's settings for one bucket."""

    endpoint: str | None
    region: str
    access_key_id: str | None
    secret_access_key: str | None
    session_token: str | None
    virtual_hosted: bool
    unsigned: bool
    #: Seconds to connect and to wait for an answer, and attempts per call: the store's
    #: `client_options` (`connect_timeout`, `timeout`) and `retry_config` (`max_retries`).
    connect_timeout: float = 10.0
    read_timeout: float = 30.0
    attempts: int = 4


def _true(value: Any) -> bool:
    return str(value).strip().lower() in ('1', 'true', 'yes', 'on')


def settings_of(config: Mapping[str, Any], env: Mapping[str, str]) -> S3Settings:
    """The botocore settings of an obstore S3 store's `config`, over the environment `env`.

    The precedence is obstore's: an option given to the store wins over its
    environment variable.
    """
    def pick(option: str, *variables: str) -> Any:
        if config.get(option) not in (None, ''):
            return config[option]
        return next((env[v] for v in variables if env.get(v)), None)

    return S3Settings(
        endpoint=pick('endpoint', 'AWS_ENDPOINT_URL_S3', 'AWS_ENDPOINT_URL', 'AWS_ENDPOINT'),
        region=pick('region', 'AWS_REGION') or pick('default_region', 'AWS_DEFAULT_REGION') or 'us-east-1',
        access_key_id=pick('access_key_id', 'AWS_ACCESS_KEY_ID'),
        secret_access_key=pick('secret_access_key', 'AWS_SECRET_ACCESS_KEY'),
        session_token=pick('session_token', 'AWS_SESSION_TOKEN', 'AWS_TOKEN'),
        virtual_hosted=_true(pick('virtual_hosted_style_request', 'AWS_VIRTUAL_HOSTED_STYLE_REQUEST')),
        unsigned=_true(pick('skip_signature', 'AWS_SKIP_SIGNATURE')))


@dataclasses.dataclass(frozen=True)
class S3Api:
    """The calls on one bucket: `keys` (a string-prefix listing), `uploads`, `abort`.

    Both listings page through everything there (a page is `PAGE` entries, S3's most):
    their one caller, `jckpt.storage.upload_markers.reclaim`, decides from all of a key's
    markers and uploads whether its writers are gone.
    """

    client: Any
    bucket: str

    def keys(self, prefix: str) -> list[tuple[str, datetime.datetime]]:
        """Every key that starts with `prefix`, with its last-modified time: `PAGE` keys a
        request, page after page (`reclaim` must see every marker of a key: a live writer's
        marker on a second page left its upload to be aborted as a dead one's)."""
        found: list[tuple[str, datetime.datetime]] = []
        more: dict[str, str] = {}
        while True:
            page = self.client.list_objects_v2(Bucket=self.bucket, Prefix=prefix, MaxKeys=PAGE, **more)
            found += [(o['Key'], o['LastModified']) for o in page.get('Contents', [])]
            token = page.get('NextContinuationToken')
            if not page.get('IsTruncated') or not token or more.get('ContinuationToken') == token:
                return found
            more = {'ContinuationToken': token}

    def uploads(self, key: str) -> list[tuple[str, datetime.datetime]]:
        """Every incomplete multipart upload of exactly `key`: `(upload id, initiated)`, `PAGE`
        a request, page after page until the listing (by key, then upload) is past `key`."""
        found: list[tuple[str, datetime.datetime]] = []
        more: dict[str, str] = {}
        while True:
            page = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=key,
                                                      MaxUploads=PAGE, **more)
            listed = page.get('Uploads', [])
            found += [(o['UploadId'], o['Initiated']) for o in listed if o['Key'] == key]
            after = {'KeyMarker': page.get('NextKeyMarker') or '',
                     'UploadIdMarker': page.get('NextUploadIdMarker') or ''}
            if not page.get('IsTruncated') or not after['KeyMarker'] or after == more \
                    or (listed and listed[-1]['Key'] > key):
                return found
            more = after

    def abort(self, key: str, upload_id: str) -> bool:
        """Abort one multipart upload of `key`; `False` when it is no longer there (done or aborted)."""
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            return True
        except Exception as e:
            if getattr(e, 'response', {}).get('Error', {}).get('Code') in ('NoSuchUpload', '404'):
                return False
            raise


def api_for(u: ObjectURL, store: Any) -> S3Api | None:
    """The botocore calls for `u`'s bucket, configured as `store` is; `None` where there are none.

    `None` for URLs that are not `s3://`, for a store that is no obstore
    `S3Store` (a ready store of another kind given to `configure`), and when
    botocore is not installed (said once in the log).
    """
    config = getattr(store, 'config', None)
    if u.kind != 's3' or type(store).__name__ != 'S3Store' or not isinstance(config, Mapping):
        return None
    settings = bounds_of(settings_of(config, os.environ), getattr(store, 'client_options', None),
                         getattr(store, 'retry_config', None))
    with _LOCK:
        client = _CLIENTS.get(settings)
        if client is None:
            client = _client(settings)
            if client is None:
                return None
            _CLIENTS[settings] = client
    return S3Api(client, u.bucket)


def bounds_of(settings: S3Settings, client_options: Mapping[str, Any] | None,
              retry_config: Mapping[str, Any] | None) -> S3Settings:
    """`settings` bounded as the store's own calls are: its `client_options`' timeouts and its
    `retry_config`'s retries (a server that never answers held botocore for its own 30 s, 3
    times, whatever `jckpt.storage.configure` said).

    >>> bounds_of(settings_of({}, {}), {'timeout': '2s', 'connect_timeout': '500ms'},
    ...           {'max_retries': 1}).read_timeout
    2.0
    """
    options, retries = dict(client_options or {}), dict(retry_config or {})
    connect, read = _seconds(options.get('connect_timeout')), _seconds(options.get('timeout'))
    attempts = retries.get('max_retries')
    return dataclasses.replace(
        settings, connect_timeout=connect or settings.connect_timeout,
        read_timeout=read or settings.read_timeout,
        attempts=int(attempts) + 1 if isinstance(attempts, int) and attempts >= 0 else settings.attempts)


def _seconds(value: Any) -> float | None:
    """A duration as obstore takes it (`timedelta`, `'2s'`, `'500ms'`, `'1m'`, a number) in
    seconds; None for none or one not understood."""
    if isinstance(value, datetime.timedelta):
        return value.total_seconds() or None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) or None
    m = re.fullmatch(r'\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h)?\s*', str(value or ''))
    if m is None:
        return None
    return float(m[1]) * {'ms': 1e-3, 's': 1, 'm': 60, 'h': 3600}[m[2] or 's'] or None


def _client(s: S3Settings) -> Any:
    try:
        session = importlib.import_module('botocore.session')
        config = importlib.import_module('botocore.config')
    except ImportError:
        if not _WARNED:
            _WARNED.append(True)
            log.warning("botocore is not installed, so incomplete multipart uploads of killed "
                        "writers cannot be found and aborted (pip install 'jckpt[cloud]'); give the "
                        "bucket a lifecycle rule that aborts them (docs/object-storage.md)")
        return None
    options: dict[str, Any] = {
        'region_name': s.region, 'connect_timeout': s.connect_timeout,
        'read_timeout': s.read_timeout, 'retries': {'total_max_attempts': s.attempts, 'mode': 'standard'},
        's3': {'addressing_style': 'virtual' if s.virtual_hosted else 'path'}}
    if s.unsigned:
        options['signature_version'] = importlib.import_module('botocore').UNSIGNED
    return session.get_session().create_client(
        's3', endpoint_url=s.endpoint or None, aws_access_key_id=s.access_key_id,
        aws_secret_access_key=s.secret_access_key, aws_session_token=s.session_token,
        config=config.Config(**options))


__all__ = ['PAGE', 'S3Api', 'S3Settings', 'api_for', 'bounds_of', 'settings_of']
