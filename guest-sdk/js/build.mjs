// Build a JavaScript controller into a component (called by `rudder build my.js`):
//   node build.mjs SOURCE OUTPUT WIT_DIR WORLD
// The SDK (rudder.js) and the script become one module: the script's imports from "rudder"
// are dropped (those names are the SDK's, in scope) and its default export is registered as
// the controller class. componentize-js comes from the project's node_modules (make setup).
import { readFile, writeFile } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const [source, output, witPath, worldName] = process.argv.slice(2);
const here = dirname(fileURLToPath(import.meta.url));
// Resolved from this file up: the repository's node_modules.
const { componentize } = await import('@bytecodealliance/componentize-js');

const sdk = await readFile(join(here, 'rudder.js'), 'utf8');
let user = await readFile(source, 'utf8');
const fromRudder = /^\s*import\s+(?:[\s\S]*?)\s+from\s+['"]rudder['"];?[ \t]*$/gm;
user = user.replace(fromRudder, (m) => m.replace(/[^\n]/g, ' '));
if (/^\s*import\s/m.test(user)) {
  console.error(`rudder: ${source}: a controller may import only from "rudder" (one file; bundle others in)`);
  process.exit(1);
}
const exportDefault = /^export\s+default\s+/m;
if (!exportDefault.test(user)) {
  console.error(`rudder: ${source}: export the controller class as the default export (export default class ... extends Controller)`);
  process.exit(1);
}
user = user.replace(exportDefault, 'const __rudderController = ');
const module = `${sdk}\n// ---- ${source}\n${user}\n;__rudderRegister(__rudderController);\n`;

const { component } = await componentize(module, {
  witPath,
  worldName,
  sourceName: 'controller.js',
  // No wasi:http (the fetch event handler would import it): a controller needs none of it.
  disableFeatures: ['http', 'fetch-event'],
});
await writeFile(output, component);
