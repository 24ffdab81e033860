-- The resource's side of fencing (examples/holder.rs): apply a write only with a token at
-- least the highest seen. KEYS[1] the resource hash, ARGV[1] the token, ARGV[2] the value.
-- Answers {1, token} when applied, {0, highest seen} when refused.
local seen = tonumber(redis.call('HGET', KEYS[1], 'token') or '0')
local tok = tonumber(ARGV[1])
if tok < seen then return {0, seen} end
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'value', ARGV[2])
return {1, tok}
