
local term = tonumber(ARGV[1])
local epoch = ARGV[2]
local stale = tonumber(ARGV[3])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
-- nil, comparable: the writer may write (comparable = same epoch and no takeover), or the
-- refusal {0, term, age} (a newer term of this epoch) / {4, term, age, epoch} (foreign).
local function fence(meta)
  local f = redis.call('HMGET', meta, 'term', 'epoch', 'fenced_ms')
  local cur = tonumber(f[1])
  if not cur then return nil, true end
  local age = now - (tonumber(f[3]) or 0)
  if f[2] and f[2] ~= epoch then
    if age < stale then return {4, cur, age, f[2]}, false end
    return nil, false
  end
  if cur > term then
    if age < stale then return {0, cur, age}, false end
    return nil, false
  end
  return nil, true
end
local function claim(meta)
  redis.call('HSET', meta, 'term', term, 'epoch', epoch, 'fenced_ms', now)
end

local refused = fence(KEYS[1])
if refused then return refused end
local m = redis.call('HMGET', KEYS[1], 'slice_ms', 'retired')
if (not m[1]) or m[2] then return {2, 0} end
if ARGV[6] == '1' then redis.call('DEL', KEYS[2]) end
if #ARGV > 6 then
  local kv = {}
  for j = 7, #ARGV do kv[#kv + 1] = ARGV[j] end
  redis.call('HSET', KEYS[2], unpack(kv))
end
if ARGV[5] ~= '' then
  redis.call('LPUSH', KEYS[3], ARGV[5])
  redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[4]) - 1)
end
return {1, 0}
