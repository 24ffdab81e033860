
local term = tonumber(ARGV[1])
local epoch = ARGV[2]
local stale = tonumber(ARGV[3])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
-- nil, comparable: the writer may write (comparable = same epoch and no takeover), or the
-- refusal {0, term, age} (a newer term of this epoch) / {4, term, age, epoch} (foreign).
local function fence(meta)
  local f = redis.call('HMGET', meta, 'term', 'epoch', 'fenced_ms', 'fence_ttl')
  local cur = tonumber(f[1])
  if not cur then return nil, true end
  local age = now - (tonumber(f[3]) or 0)
  -- A lazy task's fence is refreshed less often and says how long it holds (`fence_ttl`, ms,
  -- counted up to 10 minutes): it is stale only past the longer of that and the caller's.
  local limit = stale
  local ttl = tonumber(f[4])
  if ttl and ttl > limit then limit = math.max(stale, math.min(ttl, 600000)) end
  if f[2] and f[2] ~= epoch then
    if age < limit then return {4, cur, age, f[2]}, false end
    return nil, false
  end
  if cur > term then
    if age < limit then return {0, cur, age}, false end
    return nil, false
  end
  return nil, true
end
local function claim(meta)
  redis.call('HSET', meta, 'term', term, 'epoch', epoch, 'fenced_ms', now)
end
