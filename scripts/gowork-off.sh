#!/usr/bin/env bash
# Runs a go command in a submodule without the workspace, against the working
# tree served as the main module's VERSION (as scripts/check-modules.sh does),
# for the commands the workspace cannot run before VERSION is tagged:
#
#   scripts/gowork-off.sh VERSION DIR go get example.com/dep@v1.2.3
#   scripts/gowork-off.sh VERSION DIR go mod tidy
#
# The tree's go.sum lines are dropped from DIR/go.sum afterwards: they hash
# an untagged tree (the tag's lines are added once it is pushed).
set -euo pipefail
cd "$(dirname "$0")/.."
version=$1 dir=$2; shift 2
main=$(sed -n 's/^module //p' go.mod)
tmp=$(mktemp -d)
trap 'chmod -R u+w "$tmp" 2>/dev/null; rm -rf "$tmp"' EXIT
go run scripts/modproxy.go "$tmp/proxy" "$version" >/dev/null
shared=$(go env GOMODCACHE)
(
  cd "$dir"
  export GOWORK=off GOMODCACHE="$tmp/modcache" GONOSUMDB="$main" GOFLAGS="-modcacherw ${GOFLAGS:-}"
  export GOPROXY="file://$tmp/proxy,file://$shared/cache/download,$(go env GOPROXY)"
  "$@"
)
if [ -f "$dir/go.sum" ]; then
  grep -v "^$main $version[ /]" "$dir/go.sum" > "$tmp/go.sum" || true
  cp "$tmp/go.sum" "$dir/go.sum"
fi
