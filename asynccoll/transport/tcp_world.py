"""Forming a TCP world: the set-up of ``asynccoll.transport.tcp``'s transports.

``tcp_init`` joins a world through the rendezvous (arguments, else the environment:
``ASYNCCOLL_RANK``/``RANK``, ``ASYNCCOLL_ADDR``/``MASTER_ADDR``, ...), ``tcp_store_world``
forms one whose ranks publish their addresses as rendezvous keys (elastic training),
``tcp_local_world`` forms one in this event loop over loopback. ``startup_peers`` says which
pairs connect when a world forms, ``world_crowded`` whether its ranks share cores. The
connections and the data path are in ``asynccoll.transport.tcp``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import ipaddress
import os
import socket
from typing import Any

from .._aio import is_loopback, uncancelled
from .._exit_record import note_world
from ..algorithms import power_of_two_fold
from ..collectives import Communicator, check_int, check_timeout
from ..errors import CollectiveError, RendezvousError, RendezvousTimeout
from ..handshake import handshake_timeout as resolve_handshake_timeout
from ..tuning import Tuning, check_tuning
from ..wire import ABSOLUTE_MAX_PAYLOAD_BYTES, DEFAULT_MAX_PAYLOAD_BYTES
from .tcp import TcpTransport, _env, check_peer_loss, local_world_size

#: Worlds up to this many ranks connect every pair at start-up (as Gloo does); larger ones
#: only the pairs their ring, recursive doubling and barrier use.
MESH_RANKS = 16


def startup_peers(rank: int, world_size: int) -> list[int]:
    """The peers ``rank`` connects with when the world forms (``connect_peers``): all of
    them up to ``MESH_RANKS`` ranks; beyond, its ring neighbours, its partners in recursive
    doubling (``algorithms.recursive_doubling``) and in the dissemination barrier."""
    w, r = world_size, rank
    if w <= MESH_RANKS:
        return [p for p in range(w) if p != r]
    peers = {(r + 1) % w, (r - 1) % w}
    p, extra, rounds = power_of_two_fold(w)
    if r >= p:
        peers.add(r - p)
    else:
        if r < extra:
            peers.add(r + p)
        peers.update(r ^ (1 << k) for k in range(rounds))
    step = 1
    while step < w:
        peers.update(((r + step) % w, (r - step) % w))
        step <<= 1
    peers.discard(r)
    return sorted(peers)


#: the ports a TCP address can name
PORTS = range(65536)

#: the smallest ``max_payload`` a TCP world takes: an object collective's error (an object
#: that does not pack, or packs too large) travels as a payload that every rank raises, and
#: must fit in one frame
MIN_MAX_PAYLOAD_BYTES = 512


def check_options(*, tuning: object = None, peer_loss: str = "abort", token: object = None,
                  host_rendezvous: object = None, **addresses: object) -> None:
    """A ``TypeError`` naming the argument for a wrong type (``tuning`` not a ``Tuning``,
    ``host_rendezvous`` not a bool, an address not a str), a ``ValueError`` for a
    ``peer_loss`` that is no mode: before anything connects."""
    check_tuning(tuning)
    check_peer_loss(peer_loss)
    if token is not None and not isinstance(token, str | bytes):
        raise TypeError(f"token must be str, bytes or None, got {type(token).__name__}")
    if host_rendezvous is not None and not isinstance(host_rendezvous, bool):
        raise TypeError(f"host_rendezvous must be a bool, got {host_rendezvous!r}")
    for name, value in addresses.items():
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{name} must be a str, got {value!r}")


def check_max_payload(max_payload: object) -> int:
    """``max_payload`` as an int from ``MIN_MAX_PAYLOAD_BYTES`` to the protocol's limit
    (1 TiB): a bool, a float or a string is a ``TypeError``, a number out of range a
    ``ValueError``, each naming ``max_payload``."""
    value = check_int(max_payload, "max_payload")
    if not MIN_MAX_PAYLOAD_BYTES <= value <= ABSOLUTE_MAX_PAYLOAD_BYTES:
        raise ValueError(f"max_payload must be from {MIN_MAX_PAYLOAD_BYTES} bytes (an object "
                         f"collective's error must fit in a frame) to "
                         f"{ABSOLUTE_MAX_PAYLOAD_BYTES} bytes, got {value}")
    return value


def _env_int(value: int | None, *names: str, what: str, valid: range | None = None
             ) -> int | None:
    """``value`` (as an ``int``), or else the integer in the first of the variables ``names``
    that is set (``None`` if none is). Raises ``TypeError`` when ``value`` is not an integer
    (a NumPy integer is one; a bool, a float or a string is not), ``ValueError`` naming the
    variable (or ``what``) when it is not an integer, or not in ``valid``."""
    if value is not None:
        value = check_int(value, what.replace(" ", "_"))
        if valid is not None and value not in valid:
            raise ValueError(f"{what} {value} is out of range ({valid.start}-{valid.stop - 1})")
        return value
    name = next((n for n in names if os.environ.get(n) not in (None, "")), None)
    if name is None:
        return None
    raw = os.environ[name]
    try:
        number = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer ({what})") from None
    if valid is not None and number not in valid:
        raise ValueError(f"{name}={number} is out of range ({what}: "
                         f"{valid.start}-{valid.stop - 1})")
    return number


def _bind_address(addr: str) -> str:
    """The address a rendezvous that ranks reach at ``addr`` binds."""
    if addr == "localhost":
        return "127.0.0.1"
    try:
        mapped = getattr(ipaddress.ip_address(addr), "ipv4_mapped", None)
    except ValueError:
        return addr  # a host name: bound as it resolves
    return str(mapped) if mapped is not None else addr


def _hosting_error(exc: OSError, rank: int, where: str) -> OSError:
    """``exc``, raised binding the rendezvous rank ``rank`` hosts, saying so and what to
    change (the same errno; a lookup error as it is)."""
    if exc.errno is None or exc.errno <= 0 or isinstance(exc, socket.gaierror):
        return exc
    if exc.errno == errno.EADDRNOTAVAIL:
        fix = "ASYNCCOLL_ADDR/MASTER_ADDR must be an address of rank 0's machine"
    else:
        fix = ("ASYNCCOLL_PORT/MASTER_PORT name another port, ASYNCCOLL_RENDEZVOUS a running "
               "rendezvous")
    return OSError(exc.errno, f"rank {rank} cannot host the rendezvous on {where}: "
                              f"{os.strerror(exc.errno).lower()} ({fix})")


def _local_ip(client: Any) -> str:
    """The local IP address of the rendezvous client's connection."""
    sockname = client.local_address
    return str(sockname[0])


def _check_roster(members: dict[int, list[Any]], rank: int, world_size: int,
                  mine: tuple[str, int]) -> None:
    """Raise ``CollectiveError`` when the ranks of a full roster were started inconsistently:
    another world size, or another process joined as this rank (replacing its entry)."""
    for r, entry in sorted(members.items()):
        theirs = entry[2].get("world_size") if isinstance(entry[2], dict) else None
        if type(theirs) is int and theirs != world_size:
            raise CollectiveError(
                f"rank {r} was started with world_size {theirs}, this rank ({rank}) with "
                f"{world_size}: every rank needs the same world size")
        if r >= world_size:
            raise CollectiveError(f"rank {r} joined but world_size is {world_size}")
    _check_own_entry(members, rank, mine)


def _check_own_entry(members: dict[int, list[Any]], rank: int, mine: tuple[str, int]) -> None:
    entry = members.get(rank)
    if entry is not None and (str(entry[0]), int(entry[1])) != mine:
        raise CollectiveError(
            f"rank {rank} joined the rendezvous twice: another process (listening on "
            f"{entry[0]}:{entry[1]}) took this process's place as rank {rank}; every process "
            f"needs a distinct rank")


def _other_sizes(members: dict[int, list[Any]], world_size: int) -> str:
    """The ranks of a roster (as ``roster`` answers) started with another world size than
    ``world_size``, for a message (empty if none)."""
    others = []
    for r, entry in sorted(members.items()):
        theirs = entry[2].get("world_size") if isinstance(entry[2], dict) else None
        if type(theirs) is int and theirs != world_size:
            others.append(f"rank {r} with world_size {theirs}")
    return ", ".join(others[:4]) + (", ..." if len(others) > 4 else "")


async def _unfilled(client: Any, exc: RendezvousError, rank: int, world_size: int,
                    mine: tuple[str, int], seen: str = "", standalone: str = ""
                    ) -> CollectiveError:
    """The error for a roster that did not fill in time: which ranks never joined
    (``RendezvousTimeout``), unless those that did were started inconsistently
    (``_check_roster``: another world size, another process joined as this rank, replacing
    its entry). ``seen``: the ranks started with another world size that the roster held
    before this rank joined (a world of theirs that had formed: this rank's join started the
    next roster without them). ``standalone``: the address of the standalone rendezvous
    (``ASYNCCOLL_RENDEZVOUS``) the rank uses, empty when rank 0 hosts it."""
    try:
        members = (await client.roster(timeout=0))["members"]
    except (RendezvousError, OSError):
        waited = f"while rank {rank} waited for {world_size} ranks to join the roster"
        if standalone:  # stopped, killed or restarted: its roster went with it
            return RendezvousError(
                f"{exc} ({waited}; the standalone rendezvous at {standalone} is gone: it was "
                f"stopped, killed or restarted, and the roster with it; start the job's ranks "
                f"again once it runs)")
        # the rendezvous itself is gone: rank 0, hosting it, gave up before this rank (it
        # joined first, so its wait ended first) and closed it, or it died or was stopped
        return RendezvousError(
            f"{exc} ({waited}; a rendezvous that rank 0 hosts closes when rank 0 gives up "
            f"waiting: its error names the ranks that never joined)")
    try:
        _check_roster(members, rank, world_size, mine)
    except CollectiveError as inconsistent:
        return inconsistent
    missing = [r for r in range(world_size) if r not in members]
    if not missing:
        return exc
    listed = ", ".join(map(str, missing[:16])) + (", ..." if len(missing) > 16 else "")
    hint = (f" (when this rank ({rank}) joined, the rendezvous held a world of processes "
            f"started with another world size: {seen}; every rank needs the same world "
            f"size)") if seen else ""
    return RendezvousTimeout(f"{exc}; never joined: rank{'s' * (len(missing) > 1)} "
                             f"{listed}{hint}")


#: the key (in the job's namespace) where a rank hosting the rendezvous that gave up waiting
#: for the world to form publishes its error, for the ranks still waiting there, before it
#: closes the rendezvous (SPEC, "Rendezvous messages"); each of them answers by setting
#: ``UNFORMED_KEY + "/told/" + rank``
UNFORMED_KEY = "init/unformed"
#: how long that rank waits for those answers before it closes the rendezvous anyway
TELL_SECONDS = 2.0


async def _tell_unformed(client: Any, rank: int, error: RendezvousTimeout) -> None:
    """Rank ``rank``, hosting the rendezvous, gave up waiting for the world (``error``):
    publish why for the ranks waiting there, and wait (``TELL_SECONDS`` at most) until the
    ranks that joined have read it, since closing the rendezvous cuts them off."""
    try:
        async with asyncio.timeout(TELL_SECONDS):
            await client.set(UNFORMED_KEY, f"rank {rank}, which hosts the rendezvous, gave up "
                                           f"waiting: {error}")
            joined = (await client.roster(timeout=0))["members"]
            await client.wait([f"{UNFORMED_KEY}/told/{r}" for r in sorted(joined) if r != rank],
                              timeout=TELL_SECONDS)
    except (RendezvousError, OSError, TimeoutError):
        pass  # (best effort: a rank not told says the rendezvous closed, and why it may have)


async def _roster_unless_unformed(client: Any, rank: int, world_size: int, wait: float
                                  ) -> dict[str, Any]:
    """``client.roster(world_size, wait)``, for a rank on a rendezvous another rank hosts:
    ``RendezvousTimeout`` as soon as that rank publishes that it gave up waiting (rank 0
    joined first, so its wait ends first, and it closes the rendezvous: the ranks still
    waiting would only see the connection close)."""
    roster = asyncio.ensure_future(client.roster(world_size, wait))
    unformed = asyncio.ensure_future(client.get(UNFORMED_KEY, timeout=wait))
    try:
        await asyncio.wait({roster, unformed}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (roster, unformed):
            task.cancel()
        await asyncio.wait({roster, unformed})
    if not roster.cancelled() and roster.exception() is None:  # (formed, after all)
        return roster.result()
    if unformed.cancelled() or unformed.exception() is not None:
        return await roster  # (its error)
    with contextlib.suppress(RendezvousError, OSError, TimeoutError):
        async with asyncio.timeout(TELL_SECONDS):
            await client.set(f"{UNFORMED_KEY}/told/{rank}", b"")
    raise RendezvousTimeout(f"rank {rank} waited for {world_size} ranks to join the roster, "
                            f"but {unformed.result().decode(errors='replace')}")


def roster_job(members: dict[int, list[Any]]) -> str:
    """The job id of the world a full roster forms (SPEC, "Job ids"): a digest of every
    rank's listening address, the same on every rank that read the roster. A rank of
    another world on the same rendezvous (an earlier one, a later one), or a process that
    knows the token but not this roster, is refused its connections (``"job mismatch"``)
    instead of being taken for a rank of this one."""
    text = ";".join(f"{int(r)}={entry[0]}:{int(entry[1])}" for r, entry in sorted(members.items()))
    return "world:" + hashlib.sha256(text.encode()).hexdigest()[:32]


def world_crowded(members: Any) -> bool:
    """Whether any rank of a roster (entries ``[host, port, meta]``) said it shares a core
    (``Transport.crowded``): every rank reads the same roster, so all agree."""
    return any(len(entry) > 2 and isinstance(entry[2], dict) and entry[2].get("crowded") is True
               for entry in members)


async def tcp_init(*, rank: int | None = None, world_size: int | None = None,
                   addr: str | None = None, port: int | None = None, timeout: float = 60.0,
                   token: str | bytes | None = None, tuning: Tuning | None = None,
                   rendezvous: str | None = None, bind: str | None = None,
                   host_rendezvous: bool | None = None,
                   max_payload: int = DEFAULT_MAX_PAYLOAD_BYTES,
                   peer_loss: str = "abort", job: str | None = None,
                   handshake_timeout: float | None = None) -> Communicator:
    """Join a TCP world; see ``asynccoll.init``. ``job`` (else ``ASYNCCOLL_JOB_ID``, else
    none): the job id this rank announces to the rendezvous, whose keys and roster are the
    job's own (a standalone rendezvous serves several jobs at once that way); a rendezvous
    rank 0 hosts accepts only that job's ranks. ``handshake_timeout`` (else
    ``ASYNCCOLL_HANDSHAKE_TIMEOUT``, else 5 s): see ``asynccoll.handshake.handshake_timeout``;
    it applies to this rank's connections and to the rendezvous it hosts."""
    from ..rendezvous import RendezvousClient, RendezvousServer
    from ..rendezvous._common import MAX_WAIT_TIMEOUT

    rank = _env_int(rank, "ASYNCCOLL_RANK", "RANK", what="rank")
    world_size = _env_int(world_size, "ASYNCCOLL_WORLD_SIZE", "WORLD_SIZE", what="world size")
    if rank is None or world_size is None:
        raise ValueError("rank and world_size must be given (arguments, ASYNCCOLL_RANK/RANK and "
                         "ASYNCCOLL_WORLD_SIZE/WORLD_SIZE); start processes with `asynccoll run`")
    check_timeout(timeout)  # before anything is opened
    handshake_timeout = resolve_handshake_timeout(handshake_timeout)
    max_payload = check_max_payload(max_payload)
    check_options(tuning=tuning, peer_loss=peer_loss, token=token, addr=addr, bind=bind,
                  rendezvous=rendezvous, host_rendezvous=host_rendezvous)
    local_world_size()  # a bad (ASYNCCOLL_)LOCAL_WORLD_SIZE: before rank 0 hosts anything
    # the rendezvous bounds a wait to a day: a longer timeout (inf: none) waits that long
    wait = min(float(timeout), MAX_WAIT_TIMEOUT)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is out of range for world_size {world_size}")
    addr = addr or _env("ASYNCCOLL_ADDR", "MASTER_ADDR") or "127.0.0.1"
    port = _env_int(port, "ASYNCCOLL_PORT", "MASTER_PORT", what="port", valid=PORTS)
    port = 29500 if port is None else port
    token = token if token is not None else _env("ASYNCCOLL_TOKEN")
    rendezvous = rendezvous or _env("ASYNCCOLL_RENDEZVOUS")
    job = job if job is not None else (_env("ASYNCCOLL_JOB_ID") or "")
    if not isinstance(job, str):
        raise TypeError(f"job must be a str, not {type(job).__name__}")
    rdv_host, rdv_port = addr, port
    if rendezvous:
        host_part, _, port_part = rendezvous.rpartition(":")
        if not host_part or not port_part.isdigit() or int(port_part) not in PORTS:
            raise ValueError(f"ASYNCCOLL_RENDEZVOUS must be host:port (port 0-65535), "
                             f"got {rendezvous!r}")
        rdv_host, rdv_port = host_part, int(port_part)
    # (a rendezvous rank 0 hosts tells the ranks waiting there why it gave up: they watch)
    rank_0_hosts = host_rendezvous is None and not rendezvous and rank != 0
    if host_rendezvous is None:
        host_rendezvous = rank == 0 and not rendezvous

    server = None
    if host_rendezvous:
        # the address the ranks reach it on (127.0.0.2 too: a socket bound to 127.0.0.1
        # does not answer there), IPv4 for "localhost" and an IPv4-mapped address
        server = RendezvousServer(_bind_address(addr), rdv_port, token=token, job=job,
                                  handshake_timeout=handshake_timeout)
        try:
            await server.start()
        except OSError as exc:  # asyncio's message names neither the rendezvous nor the fix
            raise _hosting_error(exc, rank, f"{_bind_address(addr)}:{rdv_port}") from exc
        rdv_port = server.port
    transport: TcpTransport | None = None
    client = None
    try:
        try:
            client = await RendezvousClient.connect(rdv_host, rdv_port, token=token,
                                                    timeout=wait, rank=rank, job=job)
        except RendezvousTimeout as exc:
            where = ("the standalone rendezvous (ASYNCCOLL_RENDEZVOUS) does not run there"
                     if rendezvous else
                     "rank 0 hosts it: it was not started, or it gave up waiting for the "
                     "world and closed it")
            raise RendezvousTimeout(
                f"rank {rank} could not reach the rendezvous at {rdv_host}:{rdv_port} within "
                f"{wait:g} s ({where}): {exc}") from None
        if bind is None:
            bind = _env("ASYNCCOLL_BIND")
        if bind is None:
            # the address this machine uses to reach the rendezvous is one the others can reach
            bind = _local_ip(client) if not is_loopback(rdv_host) else "127.0.0.1"
        transport = TcpTransport(rank, world_size, token=token, max_payload=max_payload,
                                 peer_loss=peer_loss, handshake_timeout=handshake_timeout)
        host, lport = await transport.listen(bind, 0)
        advertised = host if host not in ("0.0.0.0", "::") else _local_ip(client)
        # (a world whose ranks were started with another world size, formed before this rank
        # came, is gone from the roster once this rank joins: remembered for the error)
        seen = _other_sizes((await client.roster(timeout=0))["members"], world_size)
        await client.join(rank, advertised, lport,
                          {"crowded": transport.yields, "world_size": world_size})
        try:
            if rank_0_hosts:
                roster = await _roster_unless_unformed(client, rank, world_size, wait)
            else:
                roster = await client.roster(world_size, wait)
        except RendezvousTimeout:
            raise
        except RendezvousError as exc:
            error = await _unfilled(client, exc, rank, world_size, (advertised, lport), seen,
                                    "" if host_rendezvous else rendezvous or "")
            if server is not None and isinstance(error, RendezvousTimeout):
                await _tell_unformed(client, rank, error)
            raise error from None
        members = roster["members"]
        _check_roster(members, rank, world_size, (advertised, lport))
        for r, entry in members.items():
            transport.addresses[int(r)] = (str(entry[0]), int(entry[1]))
        transport.job = roster_job(members)
        transport.crowded = world_crowded(members.values())
        await transport.connect_peers(startup_peers(rank, world_size))
    except BaseException:
        async def clean_up() -> None:
            if transport is not None:
                await transport.close()
            if client is not None:
                await client.close()
            if server is not None:
                await server.close()

        # all of it, even if cancelled (again) meanwhile: a close cut short skips the rest
        await uncancelled(clean_up())
        raise

    async def close_rendezvous() -> None:
        await client.close()
        if server is not None:
            await server.close()

    transport._on_close.append(close_rendezvous)
    note_world(transport)  # (under the launcher: whom its failure came from, at exit)
    return Communicator(transport, timeout=timeout, tuning=tuning, backend="tcp")


async def tcp_store_world(client: Any, prefix: str, rank: int, world_size: int, *,
                          timeout: float = 60.0, token: str | bytes | None = None,
                          job: str = "", tuning: Tuning | None = None,
                          bind: str | None = None, peer_loss: str = "abort",
                          handshake_timeout: float | None = None,
                          max_payload: int = DEFAULT_MAX_PAYLOAD_BYTES) -> Communicator:
    """Form a TCP world whose ranks publish their addresses as rendezvous keys.

    Used by elastic training, which assigns ranks itself and forms a new world per
    generation: each rank sets ``{prefix}/crowded/{rank}`` (``1`` when it shares a core with
    another rank, see ``Transport.crowded``) and then ``{prefix}/addr/{rank}`` on the
    rendezvous ``client``, and waits for every other rank's address. ``job`` (distinct per
    generation) makes the handshake refuse connections from another generation's transports.
    """
    from ..rendezvous._common import MAX_WAIT_TIMEOUT

    check_timeout(timeout)  # before anything is opened
    max_payload = check_max_payload(max_payload)
    check_options(tuning=tuning, peer_loss=peer_loss, token=token, bind=bind)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is out of range for world_size {world_size}")
    if bind is None:
        host, _ = client.local_address
        bind = "127.0.0.1" if is_loopback(host) else host
    transport = TcpTransport(rank, world_size, token=token, job=job, max_payload=max_payload,
                             peer_loss=peer_loss,
                             handshake_timeout=resolve_handshake_timeout(handshake_timeout))
    try:
        host, lport = await transport.listen(bind, 0)
        await client.set(f"{prefix}/crowded/{rank}", b"1" if transport.yields else b"0")
        await client.set(f"{prefix}/addr/{rank}", f"{host}:{lport}")
        keys = [f"{prefix}/addr/{r}" for r in range(world_size)]
        await client.wait(keys, timeout=min(float(timeout), MAX_WAIT_TIMEOUT))
        crowded = False
        for r, key in enumerate(keys):
            value = (await client.get(key, wait=False)).decode()
            peer_host, _, peer_port = value.rpartition(":")
            transport.addresses[r] = (peer_host, int(peer_port))
            # set before the address: there by now
            crowded |= await client.get(f"{prefix}/crowded/{r}", wait=False) == b"1"
        transport.crowded = crowded
        await transport.connect_peers(startup_peers(rank, world_size))
    except BaseException:
        await transport.close()
        raise
    note_world(transport)
    return Communicator(transport, timeout=timeout, tuning=tuning, backend="tcp")


async def tcp_local_world(world_size: int, *, timeout: float = 60.0,
                          tuning: Tuning | None = None, token: str | bytes | None = None,
                          max_payload: int = DEFAULT_MAX_PAYLOAD_BYTES,
                          peer_loss: str = "abort", handshake_timeout: float | None = None
                          ) -> list[Communicator]:
    """``world_size`` TCP ranks in this event loop, over loopback sockets and a real rendezvous."""
    from ..rendezvous import RendezvousServer

    check_timeout(timeout)
    handshake_timeout = resolve_handshake_timeout(handshake_timeout)
    max_payload = check_max_payload(max_payload)
    check_options(tuning=tuning, peer_loss=peer_loss, token=token)
    server = RendezvousServer("127.0.0.1", 0, token=token, handshake_timeout=handshake_timeout)
    await server.start()
    ranks = [asyncio.ensure_future(tcp_init(
        rank=r, world_size=world_size, addr="127.0.0.1", port=server.port, timeout=timeout,
        token=token, tuning=tuning, host_rendezvous=False, max_payload=max_payload,
        peer_loss=peer_loss, handshake_timeout=handshake_timeout)) for r in range(world_size)]

    async def close_all() -> None:
        for c in await asyncio.gather(*ranks, return_exceptions=True):
            if isinstance(c, Communicator):
                await c.close()
        await server.close()

    try:
        await asyncio.wait(ranks)
    except BaseException:  # cancelled while forming: the ranks formed so far are closed too
        for task in ranks:
            task.cancel()
        await uncancelled(close_all())  # (even if cancelled again meanwhile)
        raise
    failed = next((exc for exc in (task.exception() for task in ranks) if exc is not None),
                  None)
    if failed is not None:
        await uncancelled(close_all())
        raise failed
    good = [task.result() for task in ranks]
    good[0].transport._on_close.append(server.close)  # type: ignore[attr-defined]
    return good


__all__ = ["MESH_RANKS", "roster_job", "startup_peers", "tcp_init", "tcp_local_world",
           "tcp_store_world", "world_crowded"]
