
local f = {'adm', 'rej', 'ok', 'err', 'lat_sum_us', 'lat_n', 'wrej'}
local ff = 'f:' .. ARGV[1]
local seq = tonumber(ARGV[2])
local per = 6
if #KEYS > 0 and #ARGV - 2 == 7 * #KEYS then per = 7 end
local lim = 9.2e18
local sat = {[2] = true, [7] = true}
for k = 1, #KEYS do
  if redis.call('EXISTS', KEYS[k]) == 1 then
    local last = tonumber(redis.call('HGET', KEYS[k], ff) or '0') or 0
    if seq > last then
      local cur = redis.call('HMGET', KEYS[k], unpack(f, 1, per))
      for j = 1, per do
        local a = ARGV[2 + (k - 1) * per + j]
        if not (a == '0' or string.match(a, '^-?[1-9]%d*$')) or #a > 20 then
          return redis.error_reply('ERR counter not an integer: ' .. f[j] .. ' ' .. a)
        end
        local d = tonumber(a)
        if d > lim or d < -lim then
          return redis.error_reply('ERR counter overflow: ' .. f[j] .. ' ' .. a)
        end
        if d ~= 0 then
          local c = cur[j] or '0'
          if not (c == '0' or string.match(c, '^-?[1-9]%d*$')) or #c > 20 then
            return redis.error_reply('ERR counter not an integer: ' .. KEYS[k] .. ' ' .. f[j])
          end
          c = tonumber(c)
          if (c + d > lim or c + d < -lim) and not (sat[j] and d > 0) then
            return redis.error_reply('ERR counter overflow: ' .. KEYS[k] .. ' ' .. f[j])
          end
        end
      end
    end
  end
end
local n = 0
for k = 1, #KEYS do
  if redis.call('EXISTS', KEYS[k]) == 1 then
    local last = tonumber(redis.call('HGET', KEYS[k], ff) or '0') or 0
    if seq > last then
      for j = 1, per do
        local a = ARGV[2 + (k - 1) * per + j]
        local d = tonumber(a)
        if d ~= 0 then
          local c = sat[j] and d > 0 and tonumber(redis.call('HGET', KEYS[k], f[j]) or '0')
          if c and c + d > lim then
            if c < lim then redis.call('HSET', KEYS[k], f[j], '9200000000000000000') end
          else
            redis.call('HINCRBY', KEYS[k], f[j], a)
          end
        end
      end
      redis.call('HSET', KEYS[k], ff, ARGV[2])
    end
    n = n + 1
  end
end
return n
