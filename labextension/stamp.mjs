// Records which sources the built assets come from: a SHA-256 over package.json,
// tsconfig.json, src/ and style/ (tests/lab/test_lab_assets.py recomputes it and fails
// when the sources changed without `npm run build`).
import { createHash } from 'node:crypto';
import { readdirSync, readFileSync, statSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';

const here = new URL('.', import.meta.url).pathname;

function walk(dir) {
  return readdirSync(join(here, dir))
    .flatMap(name => {
      const rel = `${dir}/${name}`;
      return statSync(join(here, rel)).isDirectory() ? walk(rel) : [rel];
    });
}

const files = ['package.json', 'tsconfig.json', ...walk('src'), ...walk('style')].sort();
const hash = createHash('sha256');
for (const file of files) {
  hash.update(file + '\0');
  hash.update(readFileSync(join(here, file)));
  hash.update('\0');
}
const out = join(here, '..', 'air_magic', 'labextension', 'build-sources.json');
writeFileSync(out, JSON.stringify({ sha256: hash.digest('hex'), files }, null, 2) + '\n');
console.log(`sources ${files.length} files -> ${out}`);
