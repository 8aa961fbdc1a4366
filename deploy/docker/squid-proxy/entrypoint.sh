#!/bin/sh
# Runs squid in the foreground on $PROXY_PORT. squid's configuration has no environment
# variables (and squid 5's `-a PORT` aborts when the file names no port), and the root
# filesystem may be read-only, so the configuration reaches squid on its standard input:
# the image's file plus the port. Only digits pass: the value becomes a directive.
set -eu
port="${PROXY_PORT:-3128}"
case "$port" in
  '' | *[!0-9]*)
    echo "squid-proxy: PROXY_PORT must be a port number, not '$port'" >&2
    exit 2
    ;;
esac
# squid replaces the shell (it is the container's first process and gets SIGTERM); the
# here-document is a pipe (dash), so nothing is written to disk.
exec /usr/sbin/squid -N -f /dev/stdin <<CONFIG
$(cat /etc/squid/pod.conf)
http_port $port
CONFIG
