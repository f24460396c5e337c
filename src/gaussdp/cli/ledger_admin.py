"""Administration of the service's ledger: ``gaussdp keys create|list|revoke|rotate``,
``gaussdp tenants limits`` and ``gaussdp ledger show``."""

from __future__ import annotations

from typing import Any

import typer

from gaussdp.cli._output import JSON_HELP

DEFAULT_DB = "sqlite:///gaussdp-ledger.db"
_DB_HELP = "Ledger database URL: sqlite:///path.db (default, in the working directory) or postgresql://..."


def register(app: typer.Typer) -> None:
    keys = typer.Typer(
        help="API keys of the service's tenants (stored hashed; shown once).", no_args_is_help=True
    )
    keys.command("create")(keys_create)
    keys.command("list")(keys_list)
    keys.command("revoke")(keys_revoke)
    keys.command("rotate")(keys_rotate)
    app.add_typer(keys, name="keys")
    tenants = typer.Typer(help="Per-tenant caps.", no_args_is_help=True)
    tenants.command("limits")(tenants_limits)
    app.add_typer(tenants, name="tenants")
    ledger = typer.Typer(help="Inspect the privacy ledger.", no_args_is_help=True)
    ledger.command("show")(ledger_show)
    app.add_typer(ledger, name="ledger")


def keys_create(
    tenant: str = typer.Argument(..., help="Tenant name: letters, digits, '_', '.', '-'."),
    db: str = typer.Option(DEFAULT_DB, "--db", help=_DB_HELP),
    scope: str = typer.Option(
        "release", help="read (GET routes), release (read + releases), admin (+ audit)."
    ),
    expires_in_s: float | None = typer.Option(
        None, "--expires-in-s", help="Refused this many seconds from now."
    ),
) -> None:
    """Create an API key for TENANT and print it once (only its hash is stored)."""
    import time

    from gaussdp.budget import Ledger
    from gaussdp.errors import PrivacyError
    from gaussdp.service.keys import create_api_key

    expires_at = None if expires_in_s is None else time.time() + expires_in_s
    with Ledger(db) as ledger:
        try:
            key = create_api_key(ledger.store, tenant, scope=scope, expires_at=expires_at)
        except PrivacyError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
    typer.echo(key)
    typer.echo(f"(API key for tenant {tenant!r}: store it now, it cannot be shown again)", err=True)


def keys_list(db: str = typer.Option(DEFAULT_DB, "--db", help=_DB_HELP)) -> None:
    """List key ids and tenants (never the keys)."""
    import datetime as dt

    with _read_only_ledger(db) as ledger:
        for row in ledger.store.list_api_keys():
            when = dt.datetime.fromtimestamp(row.created_at, dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")
            expires = (
                ""
                if row.expires_at is None
                else "  expires "
                + dt.datetime.fromtimestamp(row.expires_at, dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")
            )
            revoked = "  revoked" if row.revoked else ""
            typer.echo(f"{row.key_id}  {row.tenant}  {row.scopes}  {when}{expires}{revoked}")


def keys_revoke(
    key_id: str = typer.Argument(..., help="The id shown by `gaussdp keys list`."),
    db: str = typer.Option(DEFAULT_DB, "--db", help=_DB_HELP),
) -> None:
    """Revoke a key (running servers stop accepting it within 1 s)."""
    from gaussdp.budget import Ledger

    with Ledger(db) as ledger:
        if not ledger.store.revoke_api_key(key_id):
            typer.echo(f"error: no key with id {key_id!r}", err=True)
            raise typer.Exit(2)
    typer.echo(f"revoked {key_id}")


def _read_only_ledger(db: str) -> Any:
    """The ledger at ``db`` opened read-only: a missing SQLite file is an error, never created."""
    from gaussdp.budget import Ledger
    from gaussdp.budget.store import open_store

    return Ledger(db, store=open_store(db, read_only=True))


def keys_rotate(
    key_id: str = typer.Argument(..., help="The id shown by `gaussdp keys list`."),
    db: str = typer.Option(DEFAULT_DB, "--db", help=_DB_HELP),
    grace_s: float = typer.Option(3600.0, "--grace-s", help="The old key keeps working this long."),
) -> None:
    """Print a new key with the tenant and scope of KEY_ID; the old key expires after --grace-s."""
    from gaussdp.budget import Ledger
    from gaussdp.errors import PrivacyError
    from gaussdp.service.keys import rotate_api_key

    with Ledger(db) as ledger:
        try:
            key = rotate_api_key(ledger.store, key_id, grace_s=grace_s)
        except PrivacyError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
    typer.echo(key)
    typer.echo(f"(new key; {key_id} expires in {grace_s:g} s)", err=True)


def tenants_limits(
    tenant: str = typer.Argument(..., help="Tenant name."),
    db: str = typer.Option(DEFAULT_DB, "--db", help=_DB_HELP),
    max_sessions: int | None = typer.Option(None, "--max-sessions", help="Sessions the tenant may open."),
    max_epsilon: float | None = typer.Option(
        None, "--max-epsilon", help="Total epsilon the tenant may grant its sessions."
    ),
) -> None:
    """Set TENANT's caps (none given: show them); sessions already open are counted."""
    from gaussdp._format import format_exact
    from gaussdp.budget import Ledger

    with Ledger(db) as ledger:
        if max_sessions is not None or max_epsilon is not None:
            ledger.store.set_tenant_limits(tenant, max_sessions, max_epsilon)
        limits = ledger.store.get_tenant_limits(tenant)
    if limits is None:
        typer.echo(f"{tenant}: no caps")
    else:
        typer.echo(
            f"{tenant}: sessions {limits.sessions}/{limits.max_sessions or '-'}, "
            f"epsilon granted {format_exact(limits.epsilon_granted)}/"
            f"{'-' if not limits.max_epsilon else format_exact(limits.max_epsilon)}"
        )


def ledger_show(
    prefix: str = typer.Argument("", help="Show principals whose name starts with this."),
    db: str = typer.Option(DEFAULT_DB, "--db", help=_DB_HELP + " Opened read-only."),
    json_output: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Budget, spent and charges of each principal (read-only: never creates or changes the ledger)."""
    from gaussdp.cli._output import emit_json, make_console

    with _read_only_ledger(db) as ledger:
        principals = ledger.principals(prefix)
        if json_output:
            emit_json({"principals": [_ledger_row(ledger, p) for p in principals]})
            return
        make_console().print(_ledger_table(ledger, principals))


def _ledger_row(ledger: Any, principal: str) -> dict[str, Any]:
    budget, spent = ledger.budget(principal), ledger.spent(principal)
    events = ledger.events(principal)
    return {
        "principal": principal,
        "accountant": ledger.accountant(principal),
        "budget": {"epsilon": budget.epsilon, "delta": budget.delta},
        "spent": {"epsilon": spent.epsilon, "delta": spent.delta},
        "events": [{"event": e.to_dict(), "count": c} for e, c in events],
        "charges": sum(c for _, c in events),
    }


def _ledger_table(ledger: Any, principals: list[str]) -> Any:
    """The ledger for people: budgets as configured, spent epsilon rounded up."""
    from rich.table import Table

    from gaussdp._format import format_exact, format_upper

    table = Table(title="privacy ledger")
    for col in ("principal", "accountant", "budget (eps, delta)", "events x count", "spent eps", "charges"):
        table.add_column(col)
    for p in principals:
        budget, spent = ledger.budget(p), ledger.spent(p)
        events = ", ".join(f"{_describe(e)} x {c}" for e, c in ledger.events(p))
        table.add_row(
            p,
            ledger.accountant(p),
            f"({format_exact(budget.epsilon)}, {format_exact(budget.delta)})",
            events or "-",
            format_upper(spent.epsilon),
            str(sum(c for _, c in ledger.events(p))),
        )
    return table


def _describe(event: Any) -> str:
    """An event's parameters as recorded (exact: each reads back as the float charged)."""
    from gaussdp._format import format_exact

    d = event.to_dict()
    kind = d.pop("type", type(event).__name__)
    return (
        f"{kind}("
        + ", ".join(f"{k}={format_exact(v)}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items())
        + ")"
    )
