#!/bin/sh
set -e
echo hello > /run/egress-hello
