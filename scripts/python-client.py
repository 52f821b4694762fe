"""Drives a poolmgr stack only through the Python client generated from docs/openapi.json.

Run by scripts/python-client.sh (PYTHONPATH points at the generated package `poolmgr_api`):
registers the flintlock simulator as a host, creates a pool whose template has an additional
volume (the schemas generators used to drop), waits for its VMs, claims one with a
request_id, claims again with the same request_id (the same lease, replayed), heartbeats,
releases, and reads the contract's errors as the generated Error model. Every step checks the
status and the typed answer; the first failure exits 1 with what was expected.
"""

import argparse
import sys
import time

import httpx

from poolmgr_api import AuthenticatedClient
from poolmgr_api.api.claims import claim_vm
from poolmgr_api.api.hosts import create_host, get_host
from poolmgr_api.api.leases import get_lease, heartbeat_lease, release_lease
from poolmgr_api.api.pools import create_pool, get_pool
from poolmgr_api.models import (
    AdditionalVolume,
    AdditionalVolumeSourceType0,
    ClaimVMRequest,
    ClaimVMResponse,
    Error,
    HeartbeatResponse,
    Host,
    HostCreate,
    HostCreateTls,
    IfaceType,
    Kernel,
    NetworkInterface,
    Pool,
    PoolRef,
    PoolSpec,
    PoolSpecMicrovmTemplate,
    PoolSpecReplenishment,
    RootVolume,
    RootVolumeSource,
    Strategy,
)

NAMESPACE, POOL = "default", "py"


def fail(what):
    print(f"python client: FAIL: {what}", file=sys.stderr)
    sys.exit(1)


def expect(resp, status, model, what):
    """The parsed answer of `resp`, which must have `status` and parse as `model`."""
    if resp.status_code != status:
        fail(f"{what}: expected {status}, got {resp.status_code} {resp.content[:500]!r}")
    if model is not None and not isinstance(resp.parsed, model):
        fail(f"{what}: expected a {model.__name__}, got {type(resp.parsed).__name__}: {resp.content[:500]!r}")
    print(f"python client: {what}: {resp.status_code}", file=sys.stderr)
    return resp.parsed


def expect_error(resp, status, reason, what):
    err = expect(resp, status, Error, what)
    if err.error.reason != reason or err.error.code != status:
        fail(f"{what}: expected reason {reason}, got {err.error.code} {err.error.reason}: {err.error.message}")
    return err


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--admin-token", required=True)
    p.add_argument("--client-token", required=True)
    p.add_argument("--host-address", required=True)
    a = p.parse_args()
    admin = AuthenticatedClient(base_url=a.url, token=a.admin_token, raise_on_unexpected_status=True, timeout=httpx.Timeout(30.0))
    client = AuthenticatedClient(base_url=a.url, token=a.client_token, raise_on_unexpected_status=True, timeout=httpx.Timeout(30.0))

    # Host create (HostCreate), then the host as the server keeps it.
    body = HostCreate(name="local", address=a.host_address, tls=HostCreateTls(insecure=True))
    expect(create_host.sync_detailed(client=admin, body=body), 201, Host, "create host local")
    host = expect(get_host.sync_detailed("local", client=admin), 200, Host, "get host local")
    if host.address != a.host_address or not host.tls.insecure:
        fail(f"host local reads back as {host.to_dict()}")
    expect_error(create_host.sync_detailed(client=admin, body=body), 409, "ALREADY_EXISTS", "create host local again")

    # Pool create (PoolSpec, with an AdditionalVolume), filled by the reconciler.
    spec = PoolSpec(
        namespace=NAMESPACE,
        name=POOL,
        size=2,
        flintlock_hosts=["local"],
        replenishment=PoolSpecReplenishment(strategy=Strategy.MIN_SIZE_THRESHOLD, min_size=1),
        microvm_template=PoolSpecMicrovmTemplate(
            kernel=Kernel(image="ghcr.io/liquidmetal-dev/flintlock-kernel:5.10.77", filename="boot/vmlinux"),
            root_volume=RootVolume(
                id="root", source=RootVolumeSource(container_source="ghcr.io/liquidmetal-dev/ubuntu:22.04")
            ),
            additional_volumes=[
                AdditionalVolume(
                    id="data", source=AdditionalVolumeSourceType0(container_source="ghcr.io/liquidmetal-dev/data:1")
                )
            ],
            interfaces=[NetworkInterface(device_id="eth1", type_=IfaceType.TAP)],
        ),
    )
    pool = expect(create_pool.sync_detailed(client=admin, body=spec), 201, Pool, "create pool default/py")
    if pool.spec.replenishment.min_size != 1 or len(pool.spec.microvm_template.additional_volumes) != 1:
        fail(f"pool default/py reads back as {pool.spec.to_dict()}")
    deadline = time.monotonic() + 60
    while True:
        pool = expect(get_pool.sync_detailed(NAMESPACE, POOL, client=admin), 200, Pool, "get pool default/py")
        if pool.status.available >= 2:
            break
        if time.monotonic() > deadline:
            fail(f"pool default/py did not reach 2 AVAILABLE VMs in 60 s: {pool.status.to_dict()}")
        time.sleep(0.25)

    # Claim, then the same claim again: the same lease, replayed.
    req = ClaimVMRequest(pool=PoolRef(namespace=NAMESPACE, name=POOL), request_id="py-job-1")
    first = expect(claim_vm.sync_detailed(client=client, body=req), 200, ClaimVMResponse, "claim py-job-1")
    if first.replayed or first.lease.request_id != "py-job-1" or not first.vm.id:
        fail(f"the first claim: {first.to_dict()}")
    resp = claim_vm.sync_detailed(client=client, body=req)
    again = expect(resp, 200, ClaimVMResponse, "claim py-job-1 again")
    if not again.replayed or again.lease.lease_id != first.lease.lease_id or again.vm.id != first.vm.id:
        fail(f"the replay is not the first claim's lease: {again.to_dict()} vs {first.to_dict()}")
    if again.lease.expires_at != first.lease.expires_at:
        fail("the replay moved expires_at")
    if resp.headers.get("idempotent-replayed") != "true":
        fail(f"the replay has no Idempotent-Replayed: true header: {dict(resp.headers)}")
    lease_id = first.lease.lease_id

    # Heartbeat, release, and the lease is gone.
    beat = expect(heartbeat_lease.sync_detailed(lease_id, client=client), 200, HeartbeatResponse, "heartbeat")
    if beat.lease.lease_id != lease_id or beat.lease.expires_at < first.lease.expires_at:
        fail(f"the heartbeat answered {beat.to_dict()}")
    expect(release_lease.sync_detailed(lease_id, client=client), 204, None, "release")
    expect_error(get_lease.sync_detailed(lease_id, client=client), 404, "NOT_FOUND", "get the released lease")

    # Errors in the contract's shape, through the generated model.
    gone = ClaimVMRequest(pool=PoolRef(namespace=NAMESPACE, name="nope"))
    expect_error(claim_vm.sync_detailed(client=client, body=gone), 404, "NOT_FOUND", "claim from an unknown pool")
    other = ClaimVMRequest(pool=PoolRef(namespace=NAMESPACE, name=POOL))
    expect_error(create_pool.sync_detailed(client=client, body=spec), 403, "ROLE_NOT_ALLOWED", "create pool as a client")
    expect(claim_vm.sync_detailed(client=client, body=other), 200, ClaimVMResponse, "claim without a request_id")
    print("python client: OK: host and pool create, claim, replay, heartbeat, release, errors", file=sys.stderr)


if __name__ == "__main__":
    main()
