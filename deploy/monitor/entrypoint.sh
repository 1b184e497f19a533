#!/bin/sh
# Entry point of the monitor's image (Dockerfile): runs the command as an unprivileged
# user, with the secrets compose mounts readable by it.
#
# Compose mounts a file secret as a bind mount that keeps the host file's owner and mode
# (uid/gid/mode of a file secret are not applied), and `attention-monitor keyring new`
# writes its keyring 0600 for its owner on the host: the container's user could not read
# it. Started as root, this script copies every secret an ATTENTION_MONITOR_* variable
# names under SECRETS_DIR into PRIVATE_DIR, owned by RUN_AS and readable by it alone,
# points the variable at the copy, and drops to RUN_AS. Started as any other user, it
# runs the command as it is.
#
#   ATTENTION_MONITOR_RUN_AS        uid:gid to run as (default 65534:65534, nobody)
#   ATTENTION_MONITOR_SECRETS_DIR   where compose mounts secrets (default /run/secrets)
#   ATTENTION_MONITOR_PRIVATE_DIR   where the copies go (default /run/attention-monitor)
set -eu

run_as="${ATTENTION_MONITOR_RUN_AS:-65534:65534}"
secrets="${ATTENTION_MONITOR_SECRETS_DIR:-/run/secrets}"
private="${ATTENTION_MONITOR_PRIVATE_DIR:-/run/attention-monitor}"
uid="${run_as%%:*}"
gid="${run_as##*:}"

if [ "$(id -u)" != 0 ]; then
  exec "$@"
fi

mkdir -p "$private"
chown "$uid:$gid" "$private"
chmod 0700 "$private"
for name in $(env | sed -n 's/^\(ATTENTION_MONITOR_[A-Z0-9_]*\)=.*/\1/p'); do
  eval "value=\${$name}"
  case "$value" in
    "$secrets"/*)
      if [ -f "$value" ]; then
        copy="$private/$(basename "$value")"
        install -o "$uid" -g "$gid" -m 0400 "$value" "$copy"
        export "$name=$copy"
      fi
      ;;
  esac
done
state="${ATTENTION_MONITOR_STATE_DIR:-}"
if [ -n "$state" ] && [ -d "$state" ]; then
  chown "$uid:$gid" "$state"  # a named volume is created root-owned
fi
exec setpriv --reuid="$uid" --regid="$gid" --clear-groups -- "$@"
