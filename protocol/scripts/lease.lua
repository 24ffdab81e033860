
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local m = redis.call('HMGET', KEYS[1], 'mode', 'threshold', 'lease_ms', 'version', 'retired')
if m[1] ~= 'concurrency' or m[5] or not m[2] then
  return {-1, 0, 0, 0, 0, 0, tonumber(t[1]), tonumber(t[2]), 0}
end
local cap = tonumber(m[2]) or 0
local ttl = tonumber(m[3]) or 0
if ttl <= 0 then ttl = 10000 end
local version = tonumber(m[4]) or 0
local host = ARGV[1]
local want = math.max(0, tonumber(ARGV[2]) or 0)
local seq = tonumber(ARGV[3]) or 0
local all = redis.call('HGETALL', KEYS[2])
local cur, cur_seq, others, unmet = 0, -1, 0, 0
for i = 1, #all, 2 do
  local p, e, s, u = string.match(all[i + 1], '^(%d+):(%d+):(%d+):?(%d*)$')
  -- numbers are written with %d (tostring would print a µs seq as 1.79e+15)
  p = tonumber(p); e = tonumber(e); s = tonumber(s)
  if not p then
    redis.call('HDEL', KEYS[2], all[i])
  else
    local live = e > now
    if all[i] == host then
      cur_seq = s
      if live then cur = p end
    elseif live then
      others = others + p
      unmet = unmet + (tonumber(u) or 0)
    elseif e + 10 * ttl < now then
      redis.call('HDEL', KEYS[2], all[i])
    end
  end
end
if seq < cur_seq then
  return {-3, cur, cap, others, ttl, version, tonumber(t[1]), tonumber(t[2]), unmet}
end
local hold
if want <= cur then
  hold = want
else
  hold = math.max(cur, math.min(want, cap - others))
end
if hold < 0 then hold = 0 end
redis.call('HSET', KEYS[2], host,
  string.format('%d:%d:%d:%d', hold, now + ttl, seq, math.max(0, want - hold)))
redis.call('PEXPIRE', KEYS[2], 10 * ttl + 1000)
return {1, hold, cap, others, ttl, version, tonumber(t[1]), tonumber(t[2]), unmet}
