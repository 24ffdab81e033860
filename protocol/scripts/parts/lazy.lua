
-- LAZY (protocol 5): a missing task slice is made from its meta when the leader left the task
-- lazy (idle): `lz_cap` is the cap of every slice of length `slice_ms` lying within
-- [`lz_from`, `lz_until`), as that leader would have written it; `lz_exp` is how long after
-- its end the slice is kept; `lz_fence` (`<term> <epoch>`) names the leader that wrote them:
-- a window is used only while that leader still holds the meta's fence. Never for a retired
-- task. Returns 1 when it made the slice, -2 when the meta vouches for it but Redis time is
-- outside the caller's window (PULL's: the slice is over, or not yet due), 0 otherwise. Writes nothing else (workers may
-- only read the meta): the leader sees the slice and rolls the task ahead again.
local function lazy_slice(slice, start, len, t)
  -- The task's meta, named from the slice's key (`NS:{T}:s:<start>` → `NS:{T}:meta`): read
  -- only, in the slice's slot; never another task's.
  local prefix = string.match(slice, '^(.*):s:%-?%d+$')
  if not prefix then return 0 end
  local meta = prefix .. ':meta'
  local m = redis.call('HMGET', meta, 'lz_cap', 'lz_from', 'lz_until', 'lz_exp', 'slice_ms',
    'retired', 'term', 'pacing', 'pace_burst', 'mode', 'lz_fence', 'epoch')
  -- Whole non-negative numbers only (what the leader writes): anything else makes nothing.
  for j = 1, 4 do
    if not (m[j] and #m[j] <= 16 and string.match(m[j], '^%d+$')) then return 0 end
  end
  if m[6] or not m[7] or m[11] ~= m[7] .. ' ' .. (m[12] or '') then return 0 end
  local cap, from, untl, exp = tonumber(m[1]), tonumber(m[2]), tonumber(m[3]), tonumber(m[4])
  if tonumber(m[5]) ~= len or start % len ~= 0 then return 0 end
  if start < from or start + len > untl then return 0 end
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local grace = math.min(math.floor(len / 4), 250)
  if now < start - len or now > start + len + grace then return -2 end
  redis.call('HSET', slice, 'cap', cap, 'rem', cap, 'term', m[7] or '0', 'len', len)
  if m[8] == 'smooth' and ((not m[10]) or m[10] == 'pooled') then
    redis.call('HSET', slice, 'pace', 1, 'burst', tonumber(m[9]) or 0)
  end
  redis.call('PEXPIREAT', slice, start + len + exp)
  return 1
end
