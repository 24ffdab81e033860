
local h = redis.call('HMGET', KEYS[1], 'owner', 'token')
if h[1] then
  if h[1] == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {1, tonumber(h[2]), tonumber(ARGV[2])}
  end
  return {0, tonumber(h[2]) or 0, redis.call('PTTL', KEYS[1])}
end
if redis.call('EXISTS', KEYS[2]) == 0 then
  -- A new counter (or one Redis lost) starts at Redis TIME in µs: tokens keep increasing
  -- across a Redis restart without persistence, as long as Redis' clock does not go back.
  local t = redis.call('TIME')
  redis.call('SET', KEYS[2], string.format('%d', tonumber(t[1]) * 1000000 + tonumber(t[2])))
end
local tok = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'token', tok)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {1, tok, tonumber(ARGV[2])}
