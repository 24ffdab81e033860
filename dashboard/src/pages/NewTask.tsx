// Create a task.

import { TaskForm } from '../components/TaskForm';
import { Link, navigate } from '../router';

export function NewTaskPage() {
  return (
    <div class="page narrow-page">
      <p class="crumbs">
        <Link href="/">Tasks</Link> /
      </p>
      <h1>New task</h1>
      <div class="card">
        <TaskForm onSaved={(s) => navigate(`/tasks/${encodeURIComponent(s.name)}`)} />
      </div>
    </div>
  );
}
