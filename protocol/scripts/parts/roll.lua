
local refused, comparable = fence(KEYS[1])
if refused then return refused end
local m = redis.call('HMGET', KEYS[1], 'term', 'rolled_to', 'retired', 'version', 'epoch',
  'lz_fence', 'fence_ttl')
local full = ARGV[4] == '1'
local version = tonumber(ARGV[7])
local check = comparable and ARGV[8] ~= '1'
if not full then
  if (not m[1]) or m[3] or not comparable then return {2, 0} end
  if tonumber(m[2] or '0') < tonumber(ARGV[5]) then return {2, 0} end
elseif m[3] and check and tonumber(m[3]) >= version then
  return {3, tonumber(m[3])}
end
if check and m[4] and tonumber(m[4]) > version then return {5, tonumber(m[4])} end
-- A full write that leaves the task lazy (a lazy window after the slices, none given) writes
-- no slice, so slices already there must hold this spec's caps: only over no meta at all, or
-- over a live lazy meta of this version whose window its own fence wrote. Else {6, 0}: the
-- writer writes the window ahead instead.
if full and #KEYS == 1 and ARGV[11 + 2 * tonumber(ARGV[10])] and m[1] then
  if m[3] or tonumber(m[4]) ~= version or m[6] ~= m[1] .. ' ' .. (m[5] or '') then
    return {6, 0}
  end
end
local n = tonumber(ARGV[10])
local i = 11
if n > 0 then
  -- Key overrides are replaced as a whole with the meta fields.
  for _, f in ipairs(redis.call('HKEYS', KEYS[1])) do
    if string.sub(f, 1, 3) == 'ko:' then redis.call('HDEL', KEYS[1], f) end
  end
  local kv = {}
  for j = 0, 2 * n - 1 do kv[#kv + 1] = ARGV[i + j] end
  redis.call('HSET', KEYS[1], unpack(kv))
  i = i + 2 * n
end
if full then redis.call('HDEL', KEYS[1], 'retired') end
local pm = redis.call('HMGET', KEYS[1], 'pacing', 'pace_burst', 'mode', 'slice_ms')
local len = pm[4]
local pace = '0'
local burst = 0
if pm[1] == 'smooth' and ((not pm[3]) or pm[3] == 'pooled') then
  pace = '1'
  burst = tonumber(pm[2]) or 0
end
local new_rolled = tonumber(ARGV[6])
local advanced = full or new_rolled > tonumber(m[2] or '0')
if advanced then redis.call('HSET', KEYS[1], 'rolled_to', new_rolled) end
-- The fence's lifetime (`fence_ttl`) is the lazy window's fifth field (absent or 0: the
-- callers' `stale_after`): a changed lifetime is claimed with a fresh `fenced_ms`, so a fence
-- never looks older than what it promised.
local n_slices = #KEYS - 1
local lz = 11 + 2 * n + 2 * n_slices
local ttl = tonumber(ARGV[lz + 4] or '0') or 0
if ttl <= 0 then ttl = nil end
local ttl_changed = ttl ~= tonumber(m[7] or '')
if advanced or ARGV[9] == '1' or tonumber(m[1]) ~= term or m[5] ~= epoch or ttl_changed then
  claim(KEYS[1])
  if ttl then
    redis.call('HSET', KEYS[1], 'fence_ttl', string.format('%d', ttl))
  else
    redis.call('HDEL', KEYS[1], 'fence_ttl')
  end
end
local written = 0
for k = 2, #KEYS do
  local cap = tonumber(ARGV[i])
  local exp = tonumber(ARGV[i + 1])
  i = i + 2
  local cur = redis.call('HMGET', KEYS[k], 'cap', 'pace', 'burst', 'len')
  local old = cur[1]
  if not old then
    redis.call('HSET', KEYS[k], 'cap', cap, 'rem', cap, 'term', term)
    if pace == '1' then redis.call('HSET', KEYS[k], 'pace', 1, 'burst', burst) end
    if len then redis.call('HSET', KEYS[k], 'len', len) end
    redis.call('PEXPIREAT', KEYS[k], exp)
    written = written + 1
  else
    if pace == '1' and (cur[2] ~= '1' or tonumber(cur[3]) ~= burst) then
      redis.call('HSET', KEYS[k], 'pace', 1, 'burst', burst)
    elseif pace == '0' and cur[2] then
      redis.call('HDEL', KEYS[k], 'pace', 'burst')
    end
    if len and cur[4] ~= len then redis.call('HSET', KEYS[k], 'len', len) end
    if tonumber(old) ~= cap then
      redis.call('HINCRBY', KEYS[k], 'rem', cap - tonumber(old))
      redis.call('HSET', KEYS[k], 'cap', cap, 'term', term)
      written = written + 1
    end
    local ttl = redis.call('PTTL', KEYS[k])
    if ttl == -1 or (ttl >= 0 and now + ttl < exp) then
      redis.call('PEXPIREAT', KEYS[k], exp)
    end
  end
end
if ARGV[i] then
  redis.call('HSET', KEYS[1], 'lz_cap', ARGV[i], 'lz_from', ARGV[i + 1], 'lz_until', ARGV[i + 2],
    'lz_exp', ARGV[i + 3], 'lz_fence', string.format('%d', term) .. ' ' .. epoch)
else
  redis.call('HDEL', KEYS[1], 'lz_cap', 'lz_from', 'lz_until', 'lz_exp', 'lz_fence')
end
return {1, written}
