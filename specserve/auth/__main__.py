"""``python -m specserve.auth new-key --tenant acme --name ci``: mint an API key.

Prints the key once (give it to the caller; it is not stored anywhere) and the key file entry with its digest.
"""

from __future__ import annotations

import argparse
import sys

from specserve.auth.keys import TENANT_NAME, key_entry, new_key


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specserve.auth", description="specserve API keys")
    commands = parser.add_subparsers(dest="command", required=True)
    mint = commands.add_parser("new-key", help="mint a key: print it once, and its entry for the key file")
    mint.add_argument("--tenant", required=True, help="the tenant the key acts for")
    mint.add_argument("--name", required=True, help="a name for the key (who or what holds it), for logs and revoking")
    args = parser.parse_args(argv)
    if not TENANT_NAME.match(args.tenant):
        parser.error(f"tenant {args.tenant!r}: letters, digits, '.', '_' or '-' only")
    key = new_key()
    print(f"API key (shown once; send it as `authorization: Bearer <key>`):\n  {key}\n")
    print("Add this entry under `keys:` in the API key file (--api-keys-file):")
    print(f"  {key_entry(key, args.tenant, args.name)}")
    print("Revoke the key by deleting its entry; the coordinator reloads the file without a restart.", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
