"""The conformance suite on a real S3 API: moto's server on loopback, driven through s3fs."""

from __future__ import annotations

import logging
import uuid

import boto3
import moto.server as moto_server
import pytest
import s3fs  # noqa: F401  (the s3:// store's backend, from the dev extra)
from store_conformance import StoreConformance

from deltasync.store import Conflict, Store, open_store

pytestmark = pytest.mark.slow

BUCKET = "deltasync-test"
CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}


@pytest.fixture(scope="session")
def s3_endpoint():
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **CREDENTIALS)
        client.create_bucket(Bucket=BUCKET)
        yield endpoint, client
    finally:
        server.stop()


@pytest.fixture
def make_store(s3_endpoint):
    endpoint, client = s3_endpoint
    base = f"t-{uuid.uuid4().hex}"

    def make(name: str) -> Store:
        return open_store(
            f"s3://{BUCKET}/{base}/{name}",
            client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"},
            key=CREDENTIALS["aws_access_key_id"],
            secret=CREDENTIALS["aws_secret_access_key"],
        )

    yield make
    for _ in range(100):  # bounded: each round deletes up to 1000 keys
        listed = client.list_objects_v2(Bucket=BUCKET, Prefix=base + "/").get("Contents", [])
        if not listed:
            break
        keys = [{"Key": obj["Key"]} for obj in listed]
        client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})


class TestS3Store(StoreConformance):
    atomic_races = False  # moto's conditional put is check-then-write

    def test_objects_land_under_the_prefix(self, store: Store, s3_endpoint) -> None:
        _, client = s3_endpoint
        store.put("runs/a/x.bin", b"payload")
        key = store.root.split("/", 1)[1] + "/runs/a/x.bin"
        assert client.get_object(Bucket=BUCKET, Key=key)["Body"].read() == b"payload"

    def test_swap_is_refused_by_s3_when_the_etag_went_stale(self, store: Store, monkeypatch):
        """The conditional put itself, not the client's compare: the object changes between
        the ETag read and the put, and S3 answers 412."""
        store.publish("manifest.json", b"v1")
        real_info = store.fs.info
        monkeypatch.setattr(store.fs, "info", lambda path, **kw: {**real_info(path), "ETag": '"0"'})
        with pytest.raises(Conflict, match="conditional put"):
            store.swap("manifest.json", b"v2", expected=b"v1")
        assert store.get("manifest.json") == b"v1"
        monkeypatch.setattr(store.fs, "info", real_info)
        store.swap("manifest.json", b"v2", expected=b"v1")
        assert store.get("manifest.json") == b"v2"

    def test_first_swap_is_an_exclusive_create(self, store: Store, monkeypatch):
        """`If-None-Match: *`: a writer that saw no object loses to one that created it."""
        store.publish("manifest.json", b"theirs")
        real_info = store.fs.info

        def missing(path, **kw):
            raise FileNotFoundError(path)

        monkeypatch.setattr(store.fs, "info", missing)
        with pytest.raises(Conflict, match="conditional put"):
            store.swap("manifest.json", b"mine", expected=None)
        monkeypatch.setattr(store.fs, "info", real_info)
        assert store.get("manifest.json") == b"theirs"
