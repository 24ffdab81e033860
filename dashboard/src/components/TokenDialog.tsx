// Asks for the API token when a change is refused with 401 (manager run with --api-token).

import { useEffect, useRef, useState } from 'preact/hooks';
import { tokenRequest } from '../api';
import { useStore } from '../store';

export function TokenDialog() {
  const req = useStore(tokenRequest);
  const [value, setValue] = useState('');
  const dialog = useRef<HTMLDialogElement>(null);
  const input = useRef<HTMLInputElement>(null);

  useEffect(() => {
    const d = dialog.current;
    if (!d) return;
    if (req && !d.open) {
      setValue('');
      d.showModal();
      setTimeout(() => input.current?.focus(), 0);
    } else if (!req && d.open) {
      d.close();
    }
  }, [req]);

  const submit = (e: Event) => {
    e.preventDefault();
    req?.resolve(value.trim() || null);
  };
  const cancel = () => req?.resolve(null);

  return (
    <dialog ref={dialog} class="dialog" aria-labelledby="token-title" onCancel={(e) => { e.preventDefault(); cancel(); }}>
      <form onSubmit={submit}>
        <h2 id="token-title">API token required</h2>
        <p>{req?.reason}</p>
        <label for="api-token">API token</label>
        <input
          id="api-token"
          ref={input}
          type="password"
          autocomplete="current-password"
          value={value}
          onInput={(e) => setValue(e.currentTarget.value)}
        />
        <p class="hint">Kept in this browser (local storage) and sent as <code>Authorization: Bearer …</code>.</p>
        <div class="actions">
          <button type="button" class="secondary" onClick={cancel}>
            Cancel
          </button>
          <button type="submit">Use token</button>
        </div>
      </form>
    </dialog>
  );
}
