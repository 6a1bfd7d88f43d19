"""The artifact store on the local filesystem and on a real S3-compatible server (moto) on loopback
(tests/pipelines/conftest.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from assets.resources import ArtifactStore


def test_local_store(tmp_path):
    store = ArtifactStore(root=str(tmp_path))
    path = store.put("builds/abc.json", '{"a": 1}')
    assert Path(path).read_text() == '{"a": 1}' and store.get("builds/abc.json") == '{"a": 1}'


def test_s3_store_against_a_real_server(s3_server):
    import boto3

    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").create_bucket(Bucket="builds")
    store = ArtifactStore(s3_bucket="builds", s3_endpoint_url=s3_server, s3_prefix="run1")
    uri = store.put("builds/abc.json", '{"variant": "v"}')
    assert uri == "s3://builds/run1/builds/abc.json"
    assert store.get("builds/abc.json") == '{"variant": "v"}'
    # it is really on the server: read it back with a plain client
    body = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").get_object(
        Bucket="builds", Key="run1/builds/abc.json")["Body"].read()
    assert body == b'{"variant": "v"}'
    with pytest.raises(Exception):
        ArtifactStore(s3_bucket="missing-bucket", s3_endpoint_url=s3_server).put("k", "v")
