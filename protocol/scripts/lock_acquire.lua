
local h = redis.call('HMGET', KEYS[1], 'owner', 'token')
if h[1] then
  if h[1] == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {1, tonumber(h[2]), tonumber(ARGV[2])}
  end
  return {0, tonumber(h[2]) or 0, redis.call('PTTL', KEYS[1])}
end
local raw = redis.call('GET', KEYS[2])
local c = 0
if raw then
  c = string.match(raw, '^%d+$') and tonumber(raw)
  if not c or c >= 9007199254740991 then
    return redis.error_reply('lock token counter ' .. KEYS[2] .. ' is not an integer below 2^53')
  end
end
-- The floor: Redis TIME in µs. A counter Redis lost or restored older than the last token
-- cannot produce a token below one handed out before (see the Rust docs of this script).
local t = redis.call('TIME')
local tok = math.max(c + 1, tonumber(t[1]) * 1000000 + tonumber(t[2]))
local s = string.format('%d', tok)
redis.call('SET', KEYS[2], s)
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'token', s)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {1, tok, tonumber(ARGV[2])}
