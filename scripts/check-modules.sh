#!/usr/bin/env bash
# Builds and vets each submodule without the workspace (GOWORK=off), against
# the working tree served as the main module's VERSION from a throw-away
# file-based GOPROXY: what users get once VERSION is tagged. A go.mod that
# would not resolve for them (a replace, a missing requirement, a version
# nobody can download) fails here although the workspace build passes.
#
#   scripts/check-modules.sh VERSION DIR...
set -euo pipefail
cd "$(dirname "$0")/.."
version=$1; shift
main=$(sed -n 's/^module //p' go.mod)
tmp=$(mktemp -d)
trap 'chmod -R u+w "$tmp" 2>/dev/null; rm -rf "$tmp"' EXIT

sums=$(go run scripts/modproxy.go "$tmp/proxy" "$version")
# A module cache of its own: the shared one would keep the first tree served
# as VERSION for good. Dependencies come from the shared cache's downloads.
export GOWORK=off GOMODCACHE="$tmp/modcache" GONOSUMDB="$main" GOFLAGS="-modcacherw ${GOFLAGS:-}"
export GOPROXY="file://$tmp/proxy,file://$(go env GOMODCACHE)/cache/download,$(go env GOPROXY)"

# The fresh module cache makes go report every module it copies; keep the
# errors only.
quiet() { "$@" 2> >(grep -v '^go: downloading ' >&2); }

failed=()
for m in "$@"; do
  echo "--- $m (GOWORK=off, $main@$version from the working tree)"
  modjson=$(go mod edit -json "$m/go.mod" | tr -d ' \n\t')
  if grep -q "\"Old\":{\"Path\":\"$main\"" <<<"$modjson"; then
    echo "$m/go.mod: replaces $main; go get ignores replace directives, so users could not resolve the module"
    failed+=("$m"); continue
  fi
  req=$(grep -o '"Require":\[[^]]*\]' <<<"$modjson" | grep -o "\"Path\":\"$main\",\"Version\":\"[^\"]*\"" | sed 's/.*"Version":"//; s/"$//' || true)
  if [ -n "$req" ] && [ "$req" != "$version" ]; then
    echo "$m/go.mod requires $main $req, not $version (the version about to be tagged): checked against the published $req"
  fi
  work="$tmp/mod/$m"; mkdir -p "$work"
  cp "$m/go.mod" "$work/go.mod"
  { grep -v "^$main $version[ /]" "$m/go.sum" 2>/dev/null || true; echo "$sums"; } > "$work/go.sum"
  if ! (cd "$m" && quiet go build -o /dev/null -modfile="$work/go.mod" ./... && quiet go vet -modfile="$work/go.mod" ./...); then
    failed+=("$m")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "modules that do not resolve without the workspace: ${failed[*]}"
  exit 1
fi
