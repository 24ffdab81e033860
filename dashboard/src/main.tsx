// Entry point: routes → pages inside the layout.

import { render } from 'preact';
import { Layout } from './components/Layout';
import { TokenDialog } from './components/TokenDialog';
import { AlertsPage } from './pages/Alerts';
import { ClusterPage } from './pages/Cluster';
import { NewTaskPage } from './pages/NewTask';
import { TaskPage } from './pages/Task';
import { TasksPage } from './pages/Tasks';
import { Link, usePath } from './router';
import './styles.css';

function Page({ path }: { path: string }) {
  if (path === '/' || path === '/tasks' || path === '/tasks/') return <TasksPage />;
  if (path === '/new') return <NewTaskPage />;
  if (path === '/cluster') return <ClusterPage />;
  if (path === '/alerts') return <AlertsPage />;
  const m = /^\/tasks\/([^/]+)\/?$/.exec(path);
  if (m) {
    const name = decodeURIComponent(m[1]);
    return <TaskPage key={name} name={name} />;
  }
  return (
    <div class="page">
      <h1>Not found</h1>
      <p>
        Nothing lives at <code>{path}</code>. <Link href="/">Back to the tasks</Link>
      </p>
    </div>
  );
}

function App() {
  const path = usePath();
  const title = path.startsWith('/tasks/') ? decodeURIComponent(path.slice(7)) : path.slice(1);
  document.title = title ? `${title} · Sluice` : 'Tasks · Sluice';
  return (
    <>
      <Layout>
        <Page path={path} />
      </Layout>
      <TokenDialog />
    </>
  );
}

render(<App />, document.getElementById('app')!);
