
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local h = redis.call('HMGET', KEYS[2], 'cap', 'rem')
if not h[1] then
  if lazy_slice(KEYS[2], tonumber(ARGV[4]), tonumber(ARGV[2]), t) ~= 1 then
    return {-1, 0, 0, tonumber(t[1]), tonumber(t[2]), 0}
  end
  h = redis.call('HMGET', KEYS[2], 'cap', 'rem')
end
local cap = tonumber(h[1])
local rem = tonumber(h[2]) or 0
local n = tonumber(ARGV[1])
local window = tonumber(ARGV[2]) * 1000
local rf = nil
if ARGV[5] and ARGV[5] ~= '' then
  rf = 'r:' .. ARGV[5]
  if redis.call('HEXISTS', KEYS[2], rf) == 1 then
    local inside = redis.call('ZCOUNT', KEYS[1], '(' .. (now - window), '+inf')
    return {1, math.min(cap - inside, rem), cap, tonumber(t[1]), tonumber(t[2]), 0}
  end
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
local count = redis.call('ZCARD', KEYS[1])
if count + n <= cap and rem >= n and n <= 1000 then
  local seq = redis.call('INCR', KEYS[3])
  for i = 1, n do redis.call('ZADD', KEYS[1], now, ARGV[3] .. ':' .. seq .. ':' .. i) end
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) * 2)
  redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[2]) * 2)
  rem = redis.call('HINCRBY', KEYS[2], 'rem', -n)
  redis.call('HINCRBY', KEYS[2], 'adm', n)
  if rf then redis.call('HSET', KEYS[2], rf, n) end
  return {1, math.min(cap - count - n, rem), cap, tonumber(t[1]), tonumber(t[2]), 0}
end
redis.call('HINCRBY', KEYS[2], 'rej', n)
local retry = 0
if count + n > cap then
  retry = window
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  if oldest[2] then retry = tonumber(oldest[2]) + window - now end
end
if rem < n then
  retry = math.max(retry, (tonumber(ARGV[4]) + tonumber(ARGV[2])) * 1000 - now)
end
return {0, math.min(cap - count, rem), cap, tonumber(t[1]), tonumber(t[2]), retry}
