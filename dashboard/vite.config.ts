import { defineConfig } from 'vite';

declare const process: { env: Record<string, string | undefined> };

// `npm run dev` serves the dashboard with hot reload and forwards the API to a running
// manager: SLUICE_MANAGER=http://127.0.0.1:18080 npm run dev (default http://127.0.0.1:8080).
const manager = process.env.SLUICE_MANAGER ?? 'http://127.0.0.1:8080';

export default defineConfig({
  // JSX is compiled for Preact (no framework plugin needed).
  oxc: { jsx: { runtime: 'automatic', importSource: 'preact' } },
  build: {
    outDir: 'dist',
    // dist/.gitkeep (committed, so the manager's embedded folder always exists) comes back
    // from public/.gitkeep on every build.
    emptyOutDir: true,
    sourcemap: false,
    chunkSizeWarningLimit: 400,
  },
  server: {
    proxy: {
      '/api': manager,
      '/healthz': manager,
      '/metrics': manager,
    },
  },
});
