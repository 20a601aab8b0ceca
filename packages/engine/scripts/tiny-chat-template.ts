/**
 * tiny-chat's chat template: ChatML, with tools and tool calls written as Qwen2.5 writes them
 * (a `# Tools` block in the system turn, `<tool_call>` JSON after an assistant's content, and
 * tool results as user turns of `<tool_response>`).
 */
export const TINY_CHAT_TEMPLATE = String.raw`{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '\n</tools><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if not (loop.first and tools and message.role == 'system') %}
        {%- if message.role == 'tool' %}
            {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
                {{- '<|im_start|>user' }}
            {%- endif %}
            {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
            {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
                {{- '<|im_end|>\n' }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + message.content }}
            {%- for tool_call in message.tool_calls or [] %}
                {%- if message.content or not loop.first %}
                    {{- '\n' }}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' + tool_call.function.name + '", "arguments": ' }}
                {%- if tool_call.function.arguments is string %}
                    {{- tool_call.function.arguments }}
                {%- else %}
                    {{- tool_call.function.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
`;
